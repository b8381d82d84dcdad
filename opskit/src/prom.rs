//! Prometheus `/metrics` pages: the text exposition format (0.0.4) parsed into samples,
//! and lookups by metric name and labels that fail when the series is missing.
//!
//! Why a parser of our own: the crate on crates.io for this (prometheus-parse 0.2) splits
//! label sets on `,` and `=` and does not unescape, so a label value holding either, or an
//! escaped quote, reads wrong. The format is small; this parser follows it exactly and
//! refuses what it does not understand with the line number.
//!
//! Why lookups fail on a missing series: a check that reads an absent series as 0 passes
//! vacuously when a metric is renamed. Callers pass the name constants the processes
//! export, never a string copy. The one exception, a labelled counter that has not been
//! incremented yet (the exporter renders it only from its first increment), is spelled
//! out at the call site with [`Page::absent_as_zero`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use crate::{Error, Result};

/// How long a scrape may take: short, so a stopped (SIGSTOP) or dead process is an error
/// soon, not a hang. Polling callers ask again.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(3);

/// One sample line: a series (name and label set) and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric name, with any `_total`, `_bucket`, `_sum`, `_count` suffix as written.
    pub name: String,
    /// The labels, unescaped.
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Sample {
    /// Whether every `(key, value)` of `want` is among its labels.
    pub fn matches(&self, want: &[(&str, &str)]) -> bool {
        want.iter().all(|(k, v)| self.labels.get(*k).is_some_and(|x| x == v))
    }
}

/// A parsed page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Page {
    samples: Vec<Sample>,
}

impl Page {
    /// Parses a page; the error names the first line that is not the text format.
    pub fn parse(text: &str) -> Result<Self> {
        let mut samples = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, line) in text.lines().enumerate() {
            let l = line.trim_start_matches([' ', '\t']);
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let s = parse_sample(l).map_err(|why| Error::Metric(format!("line {}: {why}: {line:?}", i + 1)))?;
            if !seen.insert((s.name.clone(), s.labels.clone())) {
                return Err(Error::Metric(format!("line {}: the series appears twice: {line:?}", i + 1)));
            }
            samples.push(s);
        }
        Ok(Self { samples })
    }

    /// Every sample, in page order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The samples of `name`.
    pub fn series<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// Whether any series of `name` is on the page.
    pub fn has(&self, name: &str) -> bool {
        self.series(name).next().is_some()
    }

    /// The value of the one series of `name` whose labels include every `labels` pair. An
    /// error when none matches, or when several do (say which with more labels, or use
    /// [`Page::sum`]).
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        let mut hits = self.series(name).filter(|s| s.matches(labels));
        match (hits.next(), hits.next()) {
            (Some(s), None) => Ok(s.value),
            (None, _) => Err(self.missing(name, labels)),
            (Some(_), Some(_)) => Err(Error::Metric(format!(
                "{} series match {}; name more labels or sum them",
                self.series(name).filter(|s| s.matches(labels)).count(),
                series_text(name, labels)
            ))),
        }
    }

    /// The sum over the series of `name` whose labels include every `labels` pair; an
    /// error when none matches.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        let mut found = None;
        for s in self.series(name).filter(|s| s.matches(labels)) {
            *found.get_or_insert(0.0) += s.value;
        }
        // `+ 0.0`: an empty or all-negative-zero sum would print as "-0".
        found.map(|v| v + 0.0).ok_or_else(|| self.missing(name, labels))
    }

    /// [`Page::sum`], or 0 when no series matches. Only for a labelled counter read before
    /// its first increment could have happened (the exporter renders a counter from its
    /// first increment on): a check built on it must also read the same counter with
    /// [`Page::sum`] once it has to exist, or it passes when the metric is renamed.
    pub fn absent_as_zero(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.sum(name, labels).unwrap_or(0.0)
    }

    /// The error for a series that is not on the page: what was asked for, and what the
    /// page has of that name (or that it has none).
    fn missing(&self, name: &str, labels: &[(&str, &str)]) -> Error {
        let have: Vec<String> = self
            .series(name)
            .take(8)
            .map(|s| {
                let l: Vec<(&str, &str)> = s.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                series_text(name, &l)
            })
            .collect();
        if have.is_empty() {
            Error::Metric(format!(
                "no series {} on the page: it has no metric of that name ({} series in all)",
                series_text(name, labels),
                self.samples.len()
            ))
        } else {
            Error::Metric(format!("no series {} on the page; it has {}", series_text(name, labels), have.join(", ")))
        }
    }
}

/// `name{k="v",...}` as the format writes it.
fn series_text(name: &str, labels: &[(&str, &str)]) -> String {
    let mut out = name.to_owned();
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            let v = v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
            let _ = write!(out, "{}{k}=\"{v}\"", if i > 0 { "," } else { "" });
        }
        out.push('}');
    }
    out
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn skip_blank(s: &str) -> &str {
    s.trim_start_matches([' ', '\t'])
}

/// `name [{labels}] value [timestamp]`.
fn parse_sample(line: &str) -> std::result::Result<Sample, String> {
    let name_len = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
    let name = &line[..name_len];
    if !name.starts_with(is_name_start) {
        return Err("no metric name".into());
    }
    let mut rest = skip_blank(&line[name_len..]);
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut fields = rest.split([' ', '\t']).filter(|f| !f.is_empty());
    let value = fields.next().ok_or("no value")?;
    let value = parse_value(value).ok_or_else(|| format!("value {value:?} is not a number"))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if let Some(extra) = fields.next() {
        return Err(format!("{extra:?} after the value and timestamp"));
    }
    Ok(Sample { name: name.to_owned(), labels, value })
}

/// The label set after its `{`, into `out`; returns what follows the closing `}`.
fn parse_labels<'a>(mut s: &'a str, out: &mut BTreeMap<String, String>) -> std::result::Result<&'a str, String> {
    loop {
        s = skip_blank(s);
        if let Some(after) = s.strip_prefix('}') {
            return Ok(after);
        }
        let key_len = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
        let key = &s[..key_len];
        if key.is_empty() || key.starts_with(|c: char| c.is_ascii_digit()) {
            return Err("a label name is missing or malformed".into());
        }
        s = skip_blank(&s[key_len..]);
        s = skip_blank(s.strip_prefix('=').ok_or_else(|| format!("no `=` after label {key}"))?);
        s = s.strip_prefix('"').ok_or_else(|| format!("label {key}'s value is not quoted"))?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("label {key}'s value has no closing quote")),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    // Prometheus keeps any other escape as written.
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => return Err(format!("label {key}'s value ends in a backslash")),
                },
                Some((_, c)) => value.push(c),
            }
        };
        if out.insert(key.to_owned(), value).is_some() {
            return Err(format!("label {key} appears twice"));
        }
        s = skip_blank(&s[end + 1..]);
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return Err(format!("expected `,` or `}}` after label {key}"));
        }
    }
}

/// A Go float as the format writes it: decimal, exponent, `NaN`, `+Inf`, `-Inf`.
fn parse_value(v: &str) -> Option<f64> {
    match v {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        // Rust also takes "inf", "infinity" and "nan" in any case, which the format does not.
        _ if v.bytes().any(|b| b.is_ascii_alphabetic() && !matches!(b, b'e' | b'E')) => None,
        _ => v.parse().ok(),
    }
}

/// GETs `http://addr/metrics` within [`SCRAPE_TIMEOUT`] and parses it; a status other than
/// 200 is an error.
pub async fn scrape(addr: &str) -> Result<Page> {
    scrape_within(addr, SCRAPE_TIMEOUT).await
}

/// [`scrape`] with another bound.
pub async fn scrape_within(addr: &str, limit: Duration) -> Result<Page> {
    let r = crate::http::Request::get(addr, "/metrics").timeout(limit).send().await?;
    if r.status != 200 {
        return Err(Error::Metric(format!("{addr}/metrics answered {}: {}", r.status, r.text())));
    }
    Page::parse(&r.text()).map_err(|e| Error::Metric(format!("{addr}/metrics: {e}")))
}

/// [`scrape`] from sync code.
pub fn scrape_blocking(addr: &str) -> Result<Page> {
    crate::http::blocking::run(scrape(addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP foo_total Foos.\n# TYPE foo_total counter\n\
        foo_total{reason=\"a\",k=\"1\"} 2\nfoo_total{reason=\"b\"} 3\nfoo_total 4\n\
        bar 1e3\n\
        \tspaced { a = \"x\" , b=\"y\", } 7 1700000000000\n";

    #[test]
    fn lookups_match_labels_and_sum() {
        let p = Page::parse(PAGE).expect("parse");
        assert_eq!(p.sum("foo_total", &[]).ok(), Some(9.0));
        assert_eq!(p.sum("foo_total", &[("reason", "a")]).ok(), Some(2.0));
        assert_eq!(p.get("foo_total", &[("reason", "b")]).ok(), Some(3.0));
        assert_eq!(p.get("bar", &[]).ok(), Some(1000.0));
        assert_eq!(
            p.get("spaced", &[("b", "y")]).ok(),
            Some(7.0),
            "blanks inside braces, a trailing comma, a timestamp"
        );
        assert!(p.has("bar") && !p.has("ba"));
    }

    #[test]
    fn a_missing_series_is_an_error_that_names_it_and_what_the_page_has() {
        let p = Page::parse(PAGE).expect("parse");
        let e = p.sum("tandem_kv_blocks_used", &[]).expect_err("missing").to_string();
        assert!(e.contains("no series tandem_kv_blocks_used") && e.contains("no metric of that name"), "{e}");
        let e = p.get("foo_total", &[("reason", "c")]).expect_err("no such label value").to_string();
        assert!(e.contains(r#"foo_total{reason="c"}"#) && e.contains(r#"foo_total{reason="b"}"#), "{e}");
        let e = p.get("foo_total", &[]).expect_err("three match").to_string();
        assert!(e.contains("3 series match"), "{e}");
        assert_eq!(p.absent_as_zero("foo_total", &[("reason", "c")]), 0.0);
        assert_eq!(p.absent_as_zero("foo_total", &[("reason", "a")]), 2.0);
    }

    #[test]
    fn label_values_are_unescaped_and_may_hold_the_separators() {
        let p =
            Page::parse("m{path=\"/a,b=c}\",quote=\"say \\\"hi\\\"\",nl=\"1\\n2\",bs=\"C:\\\\x\",other=\"\\t\"} 1\n")
                .expect("parse");
        let s = &p.samples()[0];
        assert_eq!(s.labels["path"], "/a,b=c}");
        assert_eq!(s.labels["quote"], "say \"hi\"");
        assert_eq!(s.labels["nl"], "1\n2");
        assert_eq!(s.labels["bs"], "C:\\x");
        assert_eq!(s.labels["other"], "\\t", "an unknown escape is kept as written");
        assert_eq!(p.get("m", &[("quote", "say \"hi\"")]).ok(), Some(1.0));
    }

    #[test]
    fn special_values_parse_and_words_do_not() {
        let p = Page::parse("a NaN\nb +Inf\nc -Inf\nd -1.5e-3\ne 12\n").expect("parse");
        assert!(p.get("a", &[]).is_ok_and(f64::is_nan));
        assert_eq!(p.get("b", &[]).ok(), Some(f64::INFINITY));
        assert_eq!(p.get("c", &[]).ok(), Some(f64::NEG_INFINITY));
        assert_eq!(p.get("d", &[]).ok(), Some(-0.0015));
        assert!(Page::parse("a infinity\n").is_err());
    }

    #[test]
    fn malformed_lines_are_refused_with_their_number() {
        for (bad, why) in [
            ("ok 1\nm{a=\"x} 1\n", "no closing quote"),
            ("ok 1\nm{a=x} 1\n", "not quoted"),
            ("ok 1\nm{a=\"x\" b=\"y\"} 1\n", "expected `,`"),
            ("ok 1\nm{a=\"x\",a=\"y\"} 1\n", "appears twice"),
            ("ok 1\nm\n", "no value"),
            ("ok 1\nm 1 2 3\n", "after the value"),
            ("ok 1\n1m 1\n", "no metric name"),
            ("ok 1\nok 2\n", "series appears twice"),
        ] {
            let e = Page::parse(bad).expect_err(bad).to_string();
            assert!(e.contains("line 2") && e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_page_of_the_real_exporter_parses() {
        // As metrics-exporter-prometheus renders a histogram and labelled counters.
        let page = "# TYPE tandem_kv_load_seconds histogram\n\
            tandem_kv_load_seconds_bucket{le=\"0.005\"} 0\ntandem_kv_load_seconds_bucket{le=\"+Inf\"} 3\n\
            tandem_kv_load_seconds_sum 0.75\ntandem_kv_load_seconds_count 3\n\n\
            # TYPE tandem_kv_load_failures_total counter\n\
            tandem_kv_load_failures_total{reason=\"lease_expired\"} 1\n";
        let p = Page::parse(page).expect("parse");
        assert_eq!(p.get("tandem_kv_load_seconds_bucket", &[("le", "+Inf")]).ok(), Some(3.0));
        assert_eq!(p.get("tandem_kv_load_seconds_count", &[]).ok(), Some(3.0));
        assert_eq!(p.sum("tandem_kv_load_failures_total", &[]).ok(), Some(1.0));
    }
}
