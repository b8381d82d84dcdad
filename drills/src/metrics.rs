//! Metric pages and status probes for drills: opskit's, with the drills' error type,
//! bounded by [`SCRAPE_TIMEOUT`] so a stopped (SIGSTOP) or dead process is an error soon,
//! not a hang. Lookups fail on a missing series ([`Page::sum`], [`Page::get`]).

pub use opskit::prom::{Page, SCRAPE_TIMEOUT};

use crate::HarnessError;

/// [`Page::sum`] with the error as text, for proofs (which answer `Result<String, String>`).
pub fn sum(p: &Page, name: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
    p.sum(name, labels).map_err(|e| e.to_string())
}

/// GETs `http://addr/metrics` and parses it.
pub async fn scrape(addr: &str) -> Result<Page, HarnessError> {
    Ok(opskit::prom::scrape(addr).await?)
}

/// GETs `path` on `addr` and returns the status code.
pub async fn get_status(addr: &str, path: &str) -> Result<u16, HarnessError> {
    Ok(opskit::http::status(addr, path, SCRAPE_TIMEOUT).await?)
}
