//! The names of the environment variables (and the systemd credential) that say where a team's
//! Redis bus is and carry its password: read by the store's Redis backend, and kept from the
//! agents' tools and hooks with the API keys.

/// The environment variable naming the bus (as `--bus` does).
pub const BUS_ENV: &str = "TROUPE_BUS";
/// A file holding the bus password (first line).
pub const BUS_PASSWORD_FILE_ENV: &str = "TROUPE_BUS_PASSWORD_FILE";
/// The bus password itself (the last resort: the environment of a process is readable by the
/// same user through `/proc`).
pub const BUS_PASSWORD_ENV: &str = "TROUPE_BUS_PASSWORD";
/// The name of the systemd credential holding the bus password (`LoadCredential=`).
pub const BUS_CREDENTIAL: &str = "troupe-bus-password";
