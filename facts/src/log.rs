//! How every tandem program logs: which variable sets the filter, the default level, and
//! the two line formats. One definition, so that `TANDEM_LOG=debug` means the same thing
//! to the CLI, the coordinator and both workers, and so that a program started with no log
//! settings at all prints its INFO lines (start-up, fencing, etcd trouble: what the
//! runbooks tell on-call to look for).
//!
//! The filter is `TANDEM_LOG` if set, else `RUST_LOG`, else [`DEFAULT_FILTER`], in
//! `tracing`'s directive syntax (`info`, `warn,coordinator=debug`). A filter that does not
//! parse is an error naming the variable, never a silent fallback to another level.
//!
//! Lines go to stderr: stdout belongs to what a program prints for its caller (the
//! coordinator's and workers' `listening` lines, `tandem generate`'s text). Text lines
//! are coloured only on a terminal (never in a log file or a pipe), and never with
//! `NO_COLOR` set.

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

/// The filter every tandem program reads first.
pub const FILTER_ENV: &str = "TANDEM_LOG";
/// Read when [`FILTER_ENV`] is unset: the Rust ecosystem's usual name.
pub const RUST_FILTER_ENV: &str = "RUST_LOG";
/// The line format's variable (the `--log-format` flag's env).
pub const FORMAT_ENV: &str = "TANDEM_LOG_FORMAT";
/// The filter when neither variable is set.
pub const DEFAULT_FILTER: &str = "info";

/// A log line's shape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One human-readable line per event (time, level, target, message, fields).
    #[default]
    Text,
    /// One JSON object per line, for collectors: `timestamp`, `level`, `target`,
    /// `fields` (with `message`) and the spans the event is in.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("log format `{other}` is not one of: text, json")),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Text => "text",
            Self::Json => "json",
        })
    }
}

/// The filter directives in force and the variable they came from (`None`: the default).
/// `lookup` reads a variable (the environment, in [`init`]); an empty value is unset.
pub fn directives(lookup: impl Fn(&str) -> Option<String>) -> (String, Option<&'static str>) {
    [FILTER_ENV, RUST_FILTER_ENV]
        .into_iter()
        .find_map(|var| lookup(var).filter(|v| !v.trim().is_empty()).map(|v| (v, Some(var))))
        .unwrap_or_else(|| (DEFAULT_FILTER.to_owned(), None))
}

/// Parses `directives` strictly: an unknown level or a malformed directive is an error.
pub fn filter(directives: &str) -> Result<EnvFilter, String> {
    EnvFilter::builder().parse(directives).map_err(|e| format!("`{directives}`: {e}"))
}

/// The format [`init`] installed: what a process that starts others (`tandem up`) hands
/// on to them through [`FORMAT_ENV`], so that one flag sets the whole cluster's format.
pub fn installed() -> Option<LogFormat> {
    INSTALLED.get().copied()
}

static INSTALLED: OnceLock<LogFormat> = OnceLock::new();

/// Installs the process's log subscriber: the filter from the environment (see the
/// module), lines in `format` on stderr. Call once, first thing in `main`. Errors: the
/// filter does not parse (named with its variable), or a subscriber is already installed.
pub fn init(format: LogFormat) -> Result<(), String> {
    let (text, var) = directives(|v| std::env::var(v).ok());
    let filter = filter(&text).map_err(|e| format!("{}: {e}", var.unwrap_or("default log filter")))?;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(colour);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().with_current_span(false).try_init(),
    };
    installed.map_err(|e| format!("installing the log subscriber: {e}"))?;
    let _ = INSTALLED.set(format);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn tandem_log_wins_then_rust_log_then_info() {
        assert_eq!(directives(env(&[])), ("info".to_owned(), None));
        assert_eq!(directives(env(&[("RUST_LOG", "debug")])), ("debug".to_owned(), Some("RUST_LOG")));
        assert_eq!(
            directives(env(&[("RUST_LOG", "debug"), ("TANDEM_LOG", "warn")])),
            ("warn".to_owned(), Some("TANDEM_LOG"))
        );
        assert_eq!(directives(env(&[("TANDEM_LOG", " "), ("RUST_LOG", "error")])).0, "error", "empty is unset");
    }

    #[test]
    fn a_bad_filter_is_an_error_and_formats_parse_by_name_only() {
        assert!(filter("info,coordinator=debug").is_ok());
        let e = filter("coordinator=loud").expect_err("not a level");
        assert!(e.contains("coordinator=loud"), "{e}");
        assert_eq!("json".parse(), Ok(LogFormat::Json));
        assert_eq!("text".parse(), Ok(LogFormat::Text));
        assert!("JSON".parse::<LogFormat>().expect_err("case matters").contains("text, json"));
        assert_eq!(LogFormat::Json.to_string(), "json");
    }
}
