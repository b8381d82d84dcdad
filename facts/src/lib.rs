//! Facts that several tandem programs must agree on, each written once:
//!
//! - [`metrics`]: every metric name a process exports, with its kind, its label names
//!   and the processes that export it ([`metrics::catalog`]), and the fixed label
//!   values readers rely on (outcomes, reasons). Exporters and readers (drills, tests,
//!   the docs check) name a metric by these constants, never by a copy of its string;
//! - [`state`]: the `tandem up` state file, one serde type for its writer and its readers;
//! - [`argv`]: a worker's command line, built the same way by `tandem up` and the drills;
//! - [`cpus`]: the kernel's CPU list syntax (`0-3,6`), as `--cpus` takes it;
//! - [`log`]: how every program logs: the filter variables, the default level, text or
//!   JSON lines.
//!
//! A leaf: it depends on nothing of tandem's, so a service, the CLI and a test can all
//! use it without pulling in each other. Must not: do I/O beyond reading and writing the
//! state file, or hold behaviour (recording a metric is the exporter's business). The
//! one exception is [`log::init`]: installing the log subscriber is the fact "every
//! program logs the same way", and three copies of it had already drifted apart.

#![forbid(unsafe_code)]

pub mod argv;
pub mod cpus;
pub mod log;
pub mod metrics;
pub mod state;
