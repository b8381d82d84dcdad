//! Prometheus pages read over a bare HTTP/1.1 GET with a time limit, so a
//! stopped (SIGSTOP) or dead process is an error, not a hang.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::HarnessError;

/// Longest a scrape may take.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);

/// A parsed `/metrics` page: (series name, label text without braces, value).
#[derive(Debug, Clone, Default)]
pub struct Page(Vec<(String, String, f64)>);

impl Page {
    pub fn parse(body: &str) -> Self {
        let mut out = Vec::new();
        for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let Ok(v) = value.trim().parse::<f64>() else { continue };
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            out.push((name.to_owned(), labels.to_owned(), v));
        }
        Self(out)
    }

    /// Sum of the series `name` whose labels include every `key="value"` of `labels`, or
    /// `None` when no such series is on the page (a check must not read a renamed or
    /// missing metric as 0).
    pub fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for (n, l, v) in &self.0 {
            if n == name && labels.iter().all(|(k, want)| l.contains(&format!("{k}=\"{want}\""))) {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    }

    /// Sum of the series `name` whose labels include every `key="value"` of `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(n, l, _)| n == name && labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
            .map(|(_, _, v)| v)
            .sum()
    }
}

/// GETs `http://addr/metrics`.
pub async fn scrape(addr: &str) -> Result<Page, HarnessError> {
    let fut = async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.map_err(|e| format!("send: {e}"))?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.map_err(|e| format!("read: {e}"))?;
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = raw.split_once("\r\n\r\n").ok_or("no header end")?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(format!("answered {:?}", head.lines().next().unwrap_or_default()));
        }
        Ok::<_, String>(body.to_owned())
    };
    match tokio::time::timeout(SCRAPE_TIMEOUT, fut).await {
        Ok(Ok(body)) => Ok(Page::parse(&body)),
        Ok(Err(e)) => Err(HarnessError::Metrics(format!("{addr}/metrics: {e}"))),
        Err(_) => Err(HarnessError::Metrics(format!("{addr}/metrics did not answer within {SCRAPE_TIMEOUT:?}"))),
    }
}

/// GETs `path` on `addr` and returns the status code (bounded like [`scrape`]).
pub async fn get_status(addr: &str, path: &str) -> Result<u16, HarnessError> {
    let fut = async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.map_err(|e| format!("send: {e}"))?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.map_err(|e| format!("read: {e}"))?;
        let raw = String::from_utf8_lossy(&raw);
        raw.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| "no status".to_owned())
    };
    match tokio::time::timeout(SCRAPE_TIMEOUT, fut).await {
        Ok(r) => r.map_err(|e| HarnessError::Metrics(format!("GET {addr}{path}: {e}"))),
        Err(_) => Err(HarnessError::Metrics(format!("GET {addr}{path} did not answer within {SCRAPE_TIMEOUT:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_filter_on_labels() {
        let p = Page::parse(
            "# HELP x y\nfoo_total{reason=\"a\",k=\"1\"} 2\nfoo_total{reason=\"b\"} 3\nfoo_total 4\nbar 1e3\n",
        );
        assert_eq!(p.sum("foo_total", &[]), 9.0);
        assert_eq!(p.sum("foo_total", &[("reason", "a")]), 2.0);
        assert_eq!(p.sum("bar", &[]), 1000.0);
        assert_eq!(p.sum("missing", &[]), 0.0);
    }
}
