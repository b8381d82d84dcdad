//! A chaos run's report for machines and for eyes: JUnit XML (one test case per
//! guarantee, and one for the fault actions, so a CI system shows which broke) and an
//! SVG timeline (each fault as a bar on its target's row, each request as a dot at its
//! start, as high as it took, coloured by outcome; each violation as a red line).

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use super::{ChaosReport, FaultKind};
use crate::invariants::Guarantee;

/// One request of the steady load, as the timeline draws it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestPoint {
    /// The tenant's load it belongs to (`interactive`, `batch`).
    pub load: &'static str,
    pub index: usize,
    pub start_ms: u64,
    pub e2e_ms: u64,
    /// `complete`, or the outcome's label (`http 503 queue_full`, `timeout`, ...).
    pub outcome: String,
    pub resumed: u32,
}

/// What each guarantee means to a chaos run, for its JUnit test case.
const CASES: [(Guarantee, &str); 6] = [
    (Guarantee::G1, "every request complete with its undisturbed answer, or a typed error; none lost or hung"),
    (Guarantee::G2, "KV blocks and reservations back to zero on every worker"),
    (Guarantee::G3, "no KV crosses version groups"),
    (Guarantee::G4, "no request outlives its deadline and a second"),
    (Guarantee::G5, "no panic in any log; every process stops cleanly"),
    (Guarantee::Drill, "the run's own bounds"),
];

fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 has no other control characters.
            c if c.is_control() && !matches!(c, '\n' | '\t' | '\r') => out.push('?'),
            c => out.push(c),
        }
    }
    out
}

/// The run as JUnit XML: a suite named by its seed, a case per guarantee (failed with
/// each violation of it) and one for the fault actions (failed with each that did not
/// work).
pub fn junit(r: &ChaosReport) -> String {
    let mut cases: Vec<(String, Vec<String>)> = CASES
        .iter()
        .map(|(g, what)| {
            let broke = r.violations.iter().filter(|v| v.guarantee == *g);
            let lines = broke.map(|v| format!("at {:.1} s: {}", v.at_ms as f64 / 1e3, v.detail)).collect();
            (format!("{g:?}: {what}"), lines)
        })
        .collect();
    let failed_actions = r.actions.iter().filter(|a| !a.error.is_empty());
    cases.push((
        "fault actions: every fault applied and lifted".to_owned(),
        failed_actions
            .map(|a| {
                format!("at {:.1} s: {} {} {}: {}", a.at_ms as f64 / 1e3, a.what, a.kind.name(), a.target, a.error)
            })
            .collect(),
    ));
    let failures = cases.iter().filter(|(_, f)| !f.is_empty()).count();
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        x,
        "<testsuites><testsuite name=\"tandem chaos --seed {}\" tests=\"{}\" failures=\"{failures}\" time=\"{:.3}\">",
        r.seed,
        cases.len(),
        r.duration_s
    );
    let _ = writeln!(x, "<properties><property name=\"repeat\" value=\"{}\"/></properties>", xml_escape(&r.command));
    for (name, lines) in &cases {
        let _ = write!(x, "<testcase classname=\"tandem.chaos\" name=\"{}\"", xml_escape(name));
        if lines.is_empty() {
            x.push_str("/>\n");
        } else {
            let _ = writeln!(
                x,
                "><failure message=\"{} violation(s)\">{}</failure></testcase>",
                lines.len(),
                xml_escape(&lines.join("\n"))
            );
        }
    }
    x.push_str("</testsuite></testsuites>\n");
    x
}

/// A fault kind's colour on the timeline.
fn colour(k: FaultKind) -> &'static str {
    match k {
        FaultKind::KillDecode | FaultKind::KillPrefill | FaultKind::KillCoordinator | FaultKind::KillEtcd => "#d62728",
        FaultKind::StopDecode | FaultKind::StopPrefill | FaultKind::StopCoordinator | FaultKind::StopEtcd => "#ff7f0e",
        FaultKind::KvDelay | FaultKind::KvBlackhole | FaultKind::KvCorrupt | FaultKind::KvReset => "#9467bd",
        FaultKind::Burst | FaultKind::Disconnect | FaultKind::SlowReader => "#7f7f7f",
    }
}

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 130.0;
const ROW: f64 = 18.0;
const PLOT: f64 = 220.0;

/// The run as an SVG timeline: a row per fault target with its faults as bars (an
/// instant fault as a tick), below them each request as a dot (x: its start; y: how long
/// it took, to the longest), green when complete, orange when a typed error, black
/// otherwise; every violation a red vertical line.
pub fn svg(r: &ChaosReport) -> String {
    let end_ms = r
        .load
        .iter()
        .map(|p| p.start_ms + p.e2e_ms)
        .chain(r.actions.iter().map(|a| a.at_ms))
        .chain(r.violations.iter().map(|v| v.at_ms))
        .max()
        .unwrap_or(0)
        .max((r.duration_s * 1e3) as u64)
        .max(1);
    let x = |ms: u64| LEFT + (WIDTH - LEFT - 10.0) * ms as f64 / end_ms as f64;
    // Rows by target, in first-seen order of the schedule.
    let mut rows: Vec<&str> = Vec::new();
    for p in &r.schedule {
        if !rows.contains(&p.target.as_str()) {
            rows.push(&p.target);
        }
    }
    let top = 30.0;
    let load_top = top + ROW * rows.len() as f64 + 20.0;
    let height = load_top + PLOT + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" font-family=\"sans-serif\" \
         font-size=\"11\">"
    );
    let _ = writeln!(s, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"10\" y=\"18\" font-size=\"13\">{}: {} requests, {} complete, {} violations</text>",
        xml_escape(&r.command),
        r.requests,
        r.complete,
        r.violations.len()
    );
    for (i, name) in rows.iter().enumerate() {
        let y = top + ROW * i as f64;
        let _ = writeln!(s, "<text x=\"10\" y=\"{:.1}\">{}</text>", y + 12.0, xml_escape(name));
    }
    // Bars from each apply to its lift (as it happened; a held fault never lifted runs to the end).
    let mut applied: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for a in r.actions.iter().filter(|a| a.error.is_empty()) {
        let key = (a.kind.name(), a.target.as_str());
        let row = rows.iter().position(|t| *t == a.target).unwrap_or(0);
        let y = top + ROW * row as f64 + 2.0;
        match a.what {
            "apply" if a.kind.instant() => {
                let _ = writeln!(
                    s,
                    "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"2\" height=\"14\" fill=\"{}\"><title>{} {} at {:.1} \
                     s</title></rect>",
                    x(a.at_ms),
                    colour(a.kind),
                    a.kind.name(),
                    xml_escape(&a.target),
                    a.at_ms as f64 / 1e3
                );
            }
            "apply" => {
                applied.insert(key, a.at_ms);
            }
            _ => {
                if let Some(from) = applied.remove(&key) {
                    bar(&mut s, x(from), x(a.at_ms), y, a.kind, &a.target, from, a.at_ms);
                }
            }
        }
    }
    for ((_, target), from) in applied {
        if let Some(kind) = r.actions.iter().find(|a| a.target == target && a.at_ms == from).map(|a| a.kind) {
            let row = rows.iter().position(|t| *t == target).unwrap_or(0);
            bar(&mut s, x(from), x(end_ms), top + ROW * row as f64 + 2.0, kind, target, from, end_ms);
        }
    }
    // The load: each request a dot, its height how long it took.
    let longest = r.load.iter().map(|p| p.e2e_ms).max().unwrap_or(1).max(1);
    let _ = writeln!(
        s,
        "<text x=\"10\" y=\"{:.1}\">requests</text><text x=\"10\" y=\"{:.1}\">({:.1} s top)</text>",
        load_top + 12.0,
        load_top + 26.0,
        longest as f64 / 1e3
    );
    let _ = writeln!(
        s,
        "<rect x=\"{LEFT}\" y=\"{load_top:.1}\" width=\"{:.1}\" height=\"{PLOT}\" fill=\"none\" stroke=\"#ccc\"/>",
        WIDTH - LEFT - 10.0
    );
    for p in &r.load {
        let fill = match p.outcome.as_str() {
            "complete" => "#2ca02c",
            o if o.starts_with("http ") || o.starts_with("stream_error ") => "#ff7f0e",
            _ => "#000000",
        };
        let y = load_top + PLOT - PLOT * p.e2e_ms as f64 / longest as f64;
        let _ = writeln!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{y:.1}\" r=\"2\" fill=\"{fill}\"><title>{} {}: {} in {:.2} s, {} \
             resumes</title></circle>",
            x(p.start_ms),
            p.load,
            p.index,
            xml_escape(&p.outcome),
            p.e2e_ms as f64 / 1e3,
            p.resumed
        );
    }
    for v in &r.violations {
        let _ = writeln!(
            s,
            "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"{top}\" y2=\"{1:.1}\" stroke=\"#ff0000\"><title>{2:?}: \
             {3}</title></line>",
            x(v.at_ms),
            load_top + PLOT,
            v.guarantee,
            xml_escape(&v.detail)
        );
    }
    // The time axis, every tenth of the run.
    for i in 0..=10u64 {
        let ms = end_ms * i / 10;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.0} s</text>",
            x(ms),
            load_top + PLOT + 16.0,
            ms as f64 / 1e3
        );
    }
    s.push_str("</svg>\n");
    s
}

#[allow(clippy::too_many_arguments, reason = "one bar's geometry and its tooltip")]
fn bar(s: &mut String, x0: f64, x1: f64, y: f64, kind: FaultKind, target: &str, from: u64, to: u64) {
    let _ = writeln!(
        s,
        "<rect x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"14\" fill=\"{}\" opacity=\"0.8\"><title>{} {} \
         {:.1}-{:.1} s</title></rect>",
        (x1 - x0).max(1.0),
        colour(kind),
        kind.name(),
        xml_escape(target),
        from as f64 / 1e3,
        to as f64 / 1e3
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::{Action, Found, Planned};
    use std::time::Duration;

    fn report(violations: Vec<Found>, error: &str) -> ChaosReport {
        let p = |at: u64, kind, target: &str, hold: u64| Planned {
            at: Duration::from_millis(at),
            kind,
            target: target.into(),
            hold: Duration::from_millis(hold),
        };
        let a = |at_ms, what, kind, target: &str, error: &str| Action {
            at_ms,
            what,
            kind,
            target: target.into(),
            error: error.into(),
        };
        ChaosReport {
            seed: 3,
            duration_s: 10.0,
            faults_per_minute: 12.0,
            schedule: vec![
                p(1_000, FaultKind::KillDecode, "decode-0", 2_000),
                p(4_000, FaultKind::KvReset, "kv:decode-1", 0),
            ],
            actions: vec![
                a(1_000, "apply", FaultKind::KillDecode, "decode-0", ""),
                a(3_000, "lift", FaultKind::KillDecode, "decode-0", error),
                a(4_000, "apply", FaultKind::KvReset, "kv:decode-1", ""),
            ],
            applied: BTreeMap::from([("kill-decode", 1), ("kv-reset", 1)]),
            requests: 2,
            complete: 1,
            typed_errors: BTreeMap::from([("no_worker".to_owned(), 1)]),
            resumed: 0,
            loads: BTreeMap::new(),
            kv_links: BTreeMap::new(),
            incarnations: Vec::new(),
            goodput: crate::chaos::Goodput::default(),
            load: vec![
                RequestPoint {
                    load: "interactive",
                    index: 0,
                    start_ms: 500,
                    e2e_ms: 900,
                    outcome: "complete".into(),
                    resumed: 0,
                },
                RequestPoint {
                    load: "batch",
                    index: 0,
                    start_ms: 1_200,
                    e2e_ms: 2_000,
                    outcome: "http 503 no_worker".into(),
                    resumed: 1,
                },
            ],
            violations,
            log_dir: String::new(),
            command: "tandem chaos --seed 3 <x>".into(),
        }
    }

    /// A clean run is a suite of passing cases; a broken guarantee and a failed action each
    /// fail their own case, with the detail escaped.
    #[test]
    fn junit_fails_the_case_of_each_broken_guarantee() {
        let ok = junit(&report(Vec::new(), ""));
        assert!(ok.contains("tests=\"7\" failures=\"0\""), "{ok}");
        assert!(!ok.contains("<failure"), "{ok}");
        assert!(ok.contains("value=\"tandem chaos --seed 3 &lt;x&gt;\""), "{ok}");
        let bad = junit(&report(
            vec![Found { at_ms: 2_500, guarantee: Guarantee::G1, detail: "request 1: got \"<b>\" & more".into() }],
            "no such process",
        ));
        assert!(bad.contains("failures=\"2\""), "{bad}");
        assert!(bad.contains("at 2.5 s: request 1: got &quot;&lt;b&gt;&quot; &amp; more"), "{bad}");
        assert!(bad.contains("lift kill-decode decode-0: no such process"), "{bad}");
        let g1 = bad.find("name=\"G1:").expect("a G1 case");
        assert!(bad[g1..].find("<failure").expect("a failure") < bad[g1..].find("name=\"G2:").expect("G2 after"));
    }

    /// The timeline draws what happened: a held fault as a bar from apply to lift, an
    /// instant one as a tick, each request as a dot coloured by outcome, each violation as
    /// a line, and nothing unescaped.
    #[test]
    fn the_timeline_draws_faults_requests_and_violations() {
        let clean = svg(&report(Vec::new(), ""));
        assert!(clean.starts_with("<svg") && clean.trim_end().ends_with("</svg>"));
        assert!(clean.contains("kill-decode decode-0 1.0-3.0 s"), "the bar, apply to lift: {clean}");
        assert!(clean.contains("kv-reset kv:decode-1 at 4.0 s"), "the tick: {clean}");
        assert!(clean.contains("fill=\"#2ca02c\"><title>interactive 0: complete"), "{clean}");
        assert!(clean.contains("fill=\"#ff7f0e\"><title>batch 0: http 503 no_worker in 2.00 s, 1 resumes"), "{clean}");
        assert!(!clean.contains("stroke=\"#ff0000\""), "no violation, no red line");
        assert!(!clean.contains("<x>"), "the command is escaped");
        let broken = svg(&report(vec![Found { at_ms: 5_000, guarantee: Guarantee::G2, detail: "left".into() }], ""));
        assert_eq!(broken.matches("stroke=\"#ff0000\"").count(), 1, "{broken}");
    }
}
