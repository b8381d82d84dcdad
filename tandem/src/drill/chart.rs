//! One SVG chart per drill run: each request's latency against the time it
//! started, coloured by outcome, with the fault window shaded — so a reader
//! sees at a glance what the fault did to the load and when it recovered.

use std::path::Path;

use anyhow::Context;
use drills::DrillReport;
use loadgen::Outcome;
use plotters::prelude::*;

const COMPLETE: RGBColor = RGBColor(0x2e, 0x7d, 0x32);
const TYPED: RGBColor = RGBColor(0xef, 0x6c, 0x00);
const LOST: RGBColor = RGBColor(0xc6, 0x28, 0x28);
const FAULT: RGBColor = RGBColor(0xe5, 0x39, 0x35);

/// A point per request: (start s, latency s, what it was).
fn points(r: &DrillReport) -> Vec<(f64, f64, Kind)> {
    r.load
        .records
        .iter()
        .map(|rec| {
            let kind = match &rec.outcome {
                Outcome::Complete { .. } => Kind::Complete,
                o if o.error_code().is_some() => Kind::Typed,
                _ => Kind::Lost,
            };
            (rec.start.as_secs_f64(), rec.e2e.as_secs_f64(), kind)
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Complete,
    Typed,
    Lost,
}

/// Writes `r`'s chart to `path` (SVG).
pub fn write(r: &DrillReport, path: &Path) -> anyhow::Result<()> {
    let pts = points(r);
    let ttft: Vec<(f64, f64)> =
        r.load.records.iter().filter_map(|rec| rec.ttft.map(|t| (rec.start.as_secs_f64(), t.as_secs_f64()))).collect();
    let x_end = pts
        .iter()
        .map(|p| p.0 + p.1)
        .chain(r.fault_window_ms.and_then(|w| w.1).map(|ms| ms / 1e3))
        .fold(r.wall_ms / 1e3, f64::max)
        .max(1.0);
    let y_end = pts.iter().map(|p| p.1).fold(0.5, f64::max) * 1.1;
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(draw)?;
    let title = format!(
        "{}{} — fault {}, {}/{} complete",
        r.drill,
        if r.skip_fault { " (fault skipped)" } else { "" },
        if r.fault_proven { "proven" } else { "NOT proven" },
        r.complete,
        r.requests
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(0.0..x_end, 0.0..y_end)
        .map_err(draw)?;
    chart
        .configure_mesh()
        .x_desc("request start (s from the load's start)")
        .y_desc("latency (s)")
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(draw)?;
    if let Some((a, b)) = r.fault_window_ms {
        let (a, b) = (a / 1e3, b.map_or(x_end, |b| b / 1e3).max(a + x_end / 200.0));
        chart
            .draw_series(std::iter::once(Rectangle::new([(a, 0.0), (b, y_end)], FAULT.mix(0.15).filled())))
            .map_err(draw)?
            .label("fault window")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], FAULT.mix(0.3).filled()));
    }
    for (kind, colour, label) in [
        (Kind::Complete, COMPLETE, "complete (e2e)"),
        (Kind::Typed, TYPED, "typed error"),
        (Kind::Lost, LOST, "no typed outcome (transport, timeout)"),
    ] {
        let mine: Vec<(f64, f64)> = pts.iter().filter(|p| p.2 == kind).map(|p| (p.0, p.1)).collect();
        if mine.is_empty() {
            continue;
        }
        chart
            .draw_series(mine.into_iter().map(|p| Circle::new(p, 4, colour.filled())))
            .map_err(draw)?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 7, y), 4, colour.filled()));
    }
    if !ttft.is_empty() {
        chart
            .draw_series(ttft.into_iter().map(|p| Cross::new(p, 4, BLUE.stroke_width(1))))
            .map_err(draw)?
            .label("time to first token")
            .legend(|(x, y)| Cross::new((x + 7, y), 4, BLUE.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(draw)?;
    root.present().map_err(draw).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn draw<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the chart: {e:?}")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use loadgen::{Outcome, Record, Report};

    use super::*;

    fn record(i: usize, start_ms: u64, e2e_ms: u64, outcome: Outcome) -> Record {
        Record {
            index: i,
            outcome,
            start: Duration::from_millis(start_ms),
            ttft: Some(Duration::from_millis(e2e_ms / 4)),
            itl: Vec::new(),
            output_tokens: 4,
            usage_reported: true,
            prompt_tokens: Some(40),
            cached_tokens: None,
            e2e: Duration::from_millis(e2e_ms),
            text: String::new(),
            retries: Default::default(),
            cuts: Vec::new(),
        }
    }

    #[test]
    fn a_chart_shades_the_fault_window_and_draws_every_request() {
        let done = || Outcome::Complete { finish_reason: "length".into() };
        let typed = Outcome::HttpError { status: 503, code: Some("queue_full".into()), message: String::new() };
        let records = vec![
            record(0, 0, 900, done()),
            record(1, 1000, 2500, typed),
            record(2, 1200, 700, Outcome::Transport("reset".into())),
            record(3, 3000, 800, done()),
        ];
        let r = DrillReport {
            drill: "example".into(),
            description: String::new(),
            skip_fault: false,
            fault_proven: true,
            proof: String::new(),
            requests: 4,
            complete: 2,
            typed_errors: BTreeMap::new(),
            lost: 1,
            coordinator_lost: 0,
            cut_by_fault: 0,
            leaked_blocks: 0.0,
            p99_ttft_ms: None,
            wall_ms: 3800.0,
            fault_window_ms: Some((1100.0, Some(2000.0))),
            goodput: None,
            g3_skipped_groups: Vec::new(),
            violations: Vec::new(),
            log_dir: String::new(),
            load: Report { wall: Duration::from_millis(3800), records },
        };
        let dir = std::env::temp_dir().join(format!("tandem-chart-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("example.svg");
        write(&r, &path).expect("chart");
        let svg = std::fs::read_to_string(&path).expect("read");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(svg.starts_with("<svg"), "{}", &svg[..80]);
        assert!(svg.contains("example — fault proven, 2/4 complete"));
        // The window (shaded in the fault colour), one dot per request plus one per legend entry.
        assert!(svg.contains("fill=\"#E53935\""), "no fault window");
        let dots = |hex: &str| svg.matches(hex).count();
        assert_eq!(dots("#2E7D32"), 2 + 1, "complete dots and legend");
        assert_eq!(dots("#EF6C00"), 1 + 1);
        assert_eq!(dots("#C62828"), 1 + 1);
        for label in ["fault window", "complete (e2e)", "typed error", "no typed outcome", "time to first token"] {
            assert!(svg.contains(label), "legend lacks {label}");
        }
    }
}
