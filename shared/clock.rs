//! The clocks troupe reads. The wall clock ([`crate::fsutil::now`], Unix seconds) is for what
//! people read and what is compared across hosts; an age or a wait measured on one host is
//! measured on `CLOCK_BOOTTIME`, which no step of the wall clock moves (an NTP step at boot,
//! a clock put right, a VM resumed) and which counts a suspend as time passed. A reading of it
//! means something only with the boot it was taken in ([`boot_id`]).

use std::sync::OnceLock;

/// Seconds since this host booted, suspends included (`CLOCK_BOOTTIME`).
pub fn boot() -> f64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map(|t| t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
        .unwrap_or(0.0)
}

/// This boot of this host (the kernel's `boot_id`), read once: a [`boot`] reading from
/// another boot or another host is not comparable with ours.
pub fn boot_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    })
}

/// Both clocks read at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Now {
    /// Unix seconds.
    pub wall: f64,
    /// [`boot`].
    pub boot: f64,
}

impl Now {
    pub fn read() -> Now {
        Now {
            wall: crate::fsutil::now(),
            boot: boot(),
        }
    }
}

/// When something happened, on both clocks: its age is taken on the boot clock when it was
/// read in this boot, else (another host, an older boot, a record without it) on the wall.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Stamp {
    /// Unix seconds.
    pub at: f64,
    /// [`boot`] then, with its [`boot_id`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
}

impl Stamp {
    pub fn now() -> Stamp {
        let n = Now::read();
        Stamp {
            at: n.wall,
            boot: Some(n.boot),
            boot_id: Some(boot_id().to_owned()),
        }
    }

    /// Seconds from this stamp to `now` (negative if it is later).
    pub fn age(&self, now: &Now) -> f64 {
        match (self.boot, self.boot_id.as_deref()) {
            (Some(b), Some(id)) if !id.is_empty() && id == boot_id() => now.boot - b,
            _ => now.wall - self.at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_age_in_this_boot_is_taken_on_the_boot_clock_whatever_the_wall_says() {
        let s = Stamp::now();
        let mut n = Now::read();
        n.boot = s.boot.unwrap() + 3.0;
        // The wall clock stepped ten minutes either way: the age is the boot clock's.
        n.wall = s.at + 600.0;
        assert!((s.age(&n) - 3.0).abs() < 1e-6);
        n.wall = s.at - 600.0;
        assert!((s.age(&n) - 3.0).abs() < 1e-6);
        // Another boot's (or host's) reading, or none: the wall's.
        let other = Stamp {
            boot_id: Some("another".into()),
            ..s.clone()
        };
        assert!((other.age(&n) + 600.0).abs() < 1e-6);
        let none = Stamp {
            boot: None,
            boot_id: None,
            ..s
        };
        assert!((none.age(&n) + 600.0).abs() < 1e-6);
        assert!(!boot_id().is_empty());
        assert!(boot() > 0.0);
    }
}
