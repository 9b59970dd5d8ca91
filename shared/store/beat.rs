//! Heartbeats: a key per member with an expiry, outside the change feed (a beat wakes
//! nobody), which a worker writes from its main loop to prove progress and the supervisor's
//! watchdog reads.
//!
//! A beat says who wrote it (the member's incarnation, its epoch), when, and how long the
//! step it starts may take without another beat: nothing for the idle wait (which beats at
//! least every [`IDLE_BEAT`]), a model call's longest time with its retries, a tool's own
//! timeout. No side thread beats: a worker stopped or deadlocked anywhere stops beating.
//!
//! - **files**: `beats/NAME.json`, overwritten in place without an fsync (a beat that a crash
//!   loses is only a beat; a torn one is read as none);
//! - **Redis**: the key `beat:NAME`, set with an expiry (an hour past the step's allowance)
//!   by a script fenced by the worker's incarnation ([`super::redis::Fence`]): a worker that a
//!   newer incarnation replaced cannot make its member look alive, and ends at its next beat
//!   ([`Beater::refusal`]).

use std::fs::File;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Store;
use super::redis::fenced_script;
use crate::error::{Error, Result};
use crate::teamdir::TeamDir;

/// The longest an idle worker goes between beats.
pub const IDLE_BEAT: Duration = Duration::from_secs(2);

/// One beat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Beat {
    /// The incarnation that wrote it.
    pub epoch: u64,
    /// When (Unix seconds: for display, and for a watchdog on another host or boot).
    pub at: f64,
    /// When, on the writer's `CLOCK_BOOTTIME`, and that boot's id ([`crate::clock`]): what a
    /// watchdog of the same boot ages it by, so that no step of the wall clock makes a worker
    /// look hung (or alive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// How long the step begun at `at` may take before the next beat, in seconds.
    pub allowance: f64,
    /// What that step is (`model call 7`, `tool bash`, `compaction`); none for the idle wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doing: Option<String>,
}

impl Beat {
    /// A beat of incarnation `epoch` at this moment (also a worker's start, for the
    /// watchdog: its last sign of life until its first beat).
    pub fn now(epoch: u64, allowance: f64, doing: Option<String>) -> Beat {
        let s = crate::clock::Stamp::now();
        Beat {
            epoch,
            at: s.at,
            boot: s.boot,
            boot_id: s.boot_id,
            allowance,
            doing,
        }
    }

    /// How long ago it was written, as of `now` (on the boot clock when it is of this boot;
    /// see [`crate::clock::Stamp::age`]).
    pub fn age(&self, now: &crate::clock::Now) -> f64 {
        crate::clock::Stamp {
            at: self.at,
            boot: self.boot,
            boot_id: self.boot_id.clone(),
        }
        .age(now)
    }

    /// Whether a worker whose last sign of progress is `self` is hung at `now`, for a
    /// watchdog of `watchdog` seconds: silent longer than the watchdog past its step's
    /// allowance.
    pub fn overdue(&self, now: &crate::clock::Now, watchdog: f64) -> bool {
        self.age(now) > watchdog + self.allowance
    }
}

fn beats_dir(team: &TeamDir) -> PathBuf {
    team.root().join("beats")
}

fn beat_path(team: &TeamDir, name: &str) -> PathBuf {
    beats_dir(team).join(format!("{name}.json"))
}

/// KEYS: fence, the beat. ARGV: fence value, the beat, its expiry (s).
const BEAT: &str = fenced_script!(
    r"
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"
);

static BEAT_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(BEAT));

/// Writes one member's beats; made once per incarnation.
pub struct Beater {
    epoch: u64,
    to: Target,
    /// The fence refused the last beat (see [`Beater::refusal`]).
    refused: Option<Error>,
}

enum Target {
    File(Option<File>, PathBuf),
    Redis(Box<super::redis::RedisBus>, String),
}

impl Beater {
    /// Beats of member `name`'s incarnation `epoch`, through `store`.
    pub fn new(store: Store<'_>, name: &str, epoch: u64) -> Beater {
        let to = match store {
            Store::Files(team) => Target::File(None, beat_path(team, name)),
            Store::Redis(bus) => {
                Target::Redis(Box::new(bus.clone()), bus.key(&format!("beat:{name}")))
            }
        };
        Beater {
            epoch,
            to,
            refused: None,
        }
    }

    /// Says "making progress; the step begun now may take `allowance`". A beat that cannot
    /// be written is logged (the watchdog may then take the worker for hung and restart it);
    /// one the fence refused is kept for [`Beater::refusal`].
    pub fn beat(&mut self, allowance: Duration) {
        self.beat_doing(allowance, None);
    }

    /// [`Beater::beat`], saying what the step is (`lead top` shows it as "doing now").
    pub fn beat_doing(&mut self, allowance: Duration, doing: Option<String>) {
        let beat = Beat::now(self.epoch, allowance.as_secs_f64(), doing);
        let Ok(mut bytes) = serde_json::to_vec(&beat) else {
            return;
        };
        bytes.push(b'\n');
        match self.write(&bytes, allowance) {
            Ok(()) => self.refused = None,
            Err(e @ (Error::Fenced { .. } | Error::Unfenced { .. })) => {
                if self.refused.is_none() {
                    tracing::warn!("heartbeat refused: {e}");
                }
                self.refused = Some(e);
            }
            Err(e) => tracing::debug!("heartbeat not written: {e}"),
        }
    }

    /// Whether the fence refused the last beat: this incarnation was replaced, or its fence
    /// key is gone ([`crate::fence`]). A worker waiting idle writes nothing else, so this is
    /// where it learns it may not go on: it ends with the error, as after any other refused
    /// write. Taken: the next beat says again.
    pub fn refusal(&mut self) -> Result<()> {
        match self.refused.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn write(&mut self, bytes: &[u8], allowance: Duration) -> Result<()> {
        match &mut self.to {
            Target::File(file, path) => {
                use std::os::unix::fs::FileExt;
                if file.is_none() {
                    if let Some(dir) = path.parent() {
                        crate::fsutil::create_dir(dir)?;
                    }
                    *file = Some(crate::fsutil::open_rw(path)?);
                }
                let f = file.as_ref().expect("opened above");
                f.write_all_at(bytes, 0)
                    .and_then(|()| f.set_len(bytes.len() as u64))
                    .map_err(crate::Error::io("write", &*path))
            }
            Target::Redis(bus, key) => {
                let ttl = allowance.as_secs() + 3600;
                let (fence, fence_value) = bus.fence_args();
                bus.with_conn("write a heartbeat", |c| {
                    BEAT_SCRIPT
                        .key(&fence)
                        .key(&*key)
                        .arg(&fence_value)
                        .arg(bytes)
                        .arg(ttl)
                        .invoke::<i64>(c)
                })
                .map(drop)
            }
        }
    }
}

/// Member `name`'s last beat; `None` when it has none (or one that does not parse: being
/// written).
pub fn last(store: Store<'_>, name: &str) -> Result<Option<Beat>> {
    let bytes: Option<Vec<u8>> = match store {
        Store::Files(team) => crate::fsutil::read_optional(&beat_path(team, name))?,
        Store::Redis(bus) => {
            let key = bus.key(&format!("beat:{name}"));
            bus.with_conn("read a heartbeat", |c| {
                redis::cmd("GET").arg(&key).query::<Option<Vec<u8>>>(c)
            })?
        }
    };
    Ok(bytes.and_then(|b| serde_json::from_slice(&b).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_is_overdue_past_the_watchdog_and_its_steps_allowance() {
        let idle = Beat::now(1, 0.0, None);
        let at = |secs: f64, wall_step: f64| crate::clock::Now {
            wall: idle.at + secs + wall_step,
            boot: idle.boot.unwrap() + secs,
        };
        assert!(!idle.overdue(&at(4.9, 0.0), 5.0));
        assert!(idle.overdue(&at(5.1, 0.0), 5.0));
        // A step of the wall clock, ten minutes forward or back, changes nothing.
        assert!(!idle.overdue(&at(4.9, 600.0), 5.0));
        assert!(idle.overdue(&at(5.1, -600.0), 5.0));
        let calling = Beat {
            allowance: 30.0,
            doing: Some("model call 3".into()),
            ..idle.clone()
        };
        assert!(!calling.overdue(&at(34.0, 0.0), 5.0));
        assert!(calling.overdue(&at(35.5, 0.0), 5.0));
        // A beat of another boot (or host) is aged on the wall clock.
        let elsewhere = Beat {
            boot_id: Some("another boot".into()),
            ..idle.clone()
        };
        assert!(elsewhere.overdue(&at(0.0, 600.0), 5.0));
    }

    #[test]
    fn beats_overwrite_in_place_and_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        assert_eq!(last(team.store(), "ann").unwrap(), None);
        let mut b = Beater::new(team.store(), "ann", 7);
        b.beat(Duration::from_secs(600));
        b.beat(Duration::ZERO);
        let got = last(team.store(), "ann").unwrap().unwrap();
        assert_eq!((got.epoch, got.allowance), (7, 0.0));
        assert!((crate::fsutil::now() - got.at).abs() < 5.0);
        // A torn write reads as none, never as an error.
        std::fs::write(beat_path(&team, "ann"), b"{\"epoch\":7,\"at\"").unwrap();
        assert_eq!(last(team.store(), "ann").unwrap(), None);
    }
}
