//! Diagnostics in libfabric's form, controlled by `FI_LOG_LEVEL` (silent when unset).

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// libfabric's log levels, in increasing verbosity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Warn = 0,
    Trace = 1,
    Info = 2,
    Debug = 3,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Warn => "warn",
            Level::Trace => "trace",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

/// Parses an `FI_LOG_LEVEL` value as libfabric does (`warn`, `trace`, `info`, `debug`).
pub fn parse_level(v: &str) -> Option<Level> {
    match v.trim().to_ascii_lowercase().as_str() {
        "warn" => Some(Level::Warn),
        "trace" => Some(Level::Trace),
        "info" => Some(Level::Info),
        "debug" => Some(Level::Debug),
        _ => None,
    }
}

#[inline]
fn max_level() -> Option<Level> {
    static LEVEL: OnceLock<Option<Level>> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        std::env::var("FI_LOG_LEVEL")
            .ok()
            .as_deref()
            .and_then(parse_level)
    })
}

/// Whether messages at `level` are printed.
#[inline]
pub fn enabled(level: Level) -> bool {
    max_level().is_some_and(|m| level <= m)
}

/// Prints one line as libfabric does: `libfabric:PID:TIME:rverbs:SUBSYS:FUNC():LINE<LEVEL> msg`.
pub fn emit(level: Level, subsys: &str, func: &str, line: u32, msg: std::fmt::Arguments<'_>) {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    eprintln!(
        "libfabric:{}:{}:rverbs:{}:{}():{}<{}> {}",
        std::process::id(),
        t,
        subsys,
        func,
        line,
        level.name(),
        msg
    );
}

/// `fi_log!(Level::Warn, "core", "fmt", args…)`.
#[macro_export]
macro_rules! fi_log {
    ($lvl:expr, $subsys:expr, $($arg:tt)+) => {
        if $crate::core::log::enabled($lvl) {
            $crate::core::log::emit($lvl, $subsys, module_path!(), line!(), format_args!($($arg)+));
        }
    };
}

/// Warnings: something failed or was refused, and why.
#[macro_export]
macro_rules! fi_warn { ($subsys:expr, $($arg:tt)+) => { $crate::fi_log!($crate::core::log::Level::Warn, $subsys, $($arg)+) }; }
/// What the provider decided and found.
#[macro_export]
macro_rules! fi_info { ($subsys:expr, $($arg:tt)+) => { $crate::fi_log!($crate::core::log::Level::Info, $subsys, $($arg)+) }; }
/// Step-by-step detail.
#[macro_export]
macro_rules! fi_debug { ($subsys:expr, $($arg:tt)+) => { $crate::fi_log!($crate::core::log::Level::Debug, $subsys, $($arg)+) }; }

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_like_libfabric_and_order_by_verbosity() {
        assert_eq!(parse_level("WARN"), Some(Level::Warn));
        assert_eq!(parse_level(" debug "), Some(Level::Debug));
        assert_eq!(parse_level("loud"), None);
        assert!(Level::Warn < Level::Info && Level::Info < Level::Debug);
    }
}
