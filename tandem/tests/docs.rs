//! The docs cannot drift from the code: each list or count that README.md and
//! docs/*.md state, and the code also knows, is compared here, and a test
//! fails naming every item found on one side only.
//!
//! - drills: README's drill table and every "N drills"/"N faults" against
//!   `tandem drill --list` (the built binary);
//! - metrics: every `tandem_*` name in the docs is an exported
//!   `pub const NAME: &str = "tandem_..."` in some crate's `src/`, and every
//!   such constant is documented;
//! - error codes: README's overload-contract table against the `code`s the
//!   coordinator's sources can put in an error body;
//! - `tandem up` flags: README's up-flags table against `tandem up --help`.
//! - coordinator flags: README's flag table against `tandem-coordinator`'s
//!   clap struct;
//! - crates and paths: every workspace member is in README's map, and every
//!   source path the docs name exists;
//! - log lines: every log line the docs and runbooks quote (a backticked span right
//!   after `logs`, `log:`, `logged` or `line`) is a message some product source emits.
//!
//! No cluster, no model: sources are read as text, so a change of shape there
//! (codes moved into an enum, say) shows up as a failure to update this file,
//! never as a silent pass.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tandem/ lies inside the workspace").to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// README.md and docs/*.md, as (relative path, text).
fn docs() -> Vec<(String, String)> {
    let mut out = vec![("README.md".to_owned(), read(&root().join("README.md")))];
    let dir = root().join("docs");
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display())) {
        let path = entry.expect("reading a docs/ entry").path();
        if path.extension().is_some_and(|x| x == "md") {
            let name = path.file_name().expect("a file name").to_string_lossy();
            out.push((format!("docs/{name}"), read(&path)));
        }
    }
    out
}

/// The workspace members, from the root Cargo.toml's `members = [...]`.
fn members() -> Vec<String> {
    let toml = read(&root().join("Cargo.toml"));
    let line = toml.lines().find(|l| l.trim_start().starts_with("members")).expect("a `members = [...]` line");
    line.split('"').skip(1).step_by(2).map(str::to_owned).collect()
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for entry in entries {
        let path = entry.unwrap_or_else(|e| panic!("listing {}: {e}", dir.display())).path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    out
}

/// The spans between backticks.
fn ticks(s: &str) -> Vec<&str> {
    s.split('`').skip(1).step_by(2).collect()
}

/// The text outside fenced code blocks (whose three backticks would
/// unbalance the inline pairs).
fn prose(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The body rows (cells split) of README's table between `<!-- NAME` and
/// `<!-- NAME end -->`.
fn table(readme: &str, name: &str) -> Vec<Vec<String>> {
    let begin = readme.find(&format!("<!-- {name}:")).unwrap_or_else(|| panic!("README lacks `<!-- {name}: ... -->`"));
    let end =
        readme.find(&format!("<!-- {name} end -->")).unwrap_or_else(|| panic!("README lacks `<!-- {name} end -->`"));
    let rows: Vec<Vec<String>> = readme[begin..end]
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|---"))
        .skip(1) // the header
        .map(|l| l.trim().trim_matches('|').split(" | ").map(|c| c.trim().to_owned()).collect())
        .collect();
    assert!(!rows.is_empty(), "README's {name} table has no rows");
    rows
}

/// Fails naming what only one side has.
fn assert_same(what: &str, documented: &BTreeSet<String>, in_code: &BTreeSet<String>, code_is: &str) {
    let undocumented: Vec<_> = in_code.difference(documented).collect();
    let stale: Vec<_> = documented.difference(in_code).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "{what}: in {code_is} but not documented: {undocumented:?}; documented but not in {code_is}: {stale:?}"
    );
}

/// Every number stated as "N drills", "N faults" or "drills (N)", with the
/// words around it.
fn drill_counts(text: &str) -> Vec<(usize, String)> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut out = Vec::new();
    for (i, pair) in words.windows(2).enumerate() {
        let noun = |w: &str| matches!(w.trim_end_matches(|c: char| !c.is_alphanumeric()), "drills" | "faults");
        let n = if noun(pair[1]) {
            pair[0].parse().ok()
        } else if pair[0] == "drills" && pair[1].starts_with('(') {
            pair[1].trim_start_matches('(').split(')').next().and_then(|d| d.parse().ok())
        } else {
            None
        };
        if let Some(n) = n {
            out.push((n, words[i.saturating_sub(3)..(i + 3).min(words.len())].join(" ")));
        }
    }
    out
}

#[test]
fn the_drill_table_and_counts_match_tandem_drill_list() {
    let out =
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(["drill", "--list"]).output().expect("run tandem drill --list");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 from tandem drill --list");
    assert!(out.status.success(), "tandem drill --list failed: {}", String::from_utf8_lossy(&out.stderr));
    let listed: Vec<String> = stdout.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect();
    assert!(!listed.is_empty(), "tandem drill --list printed no drill");
    let n = listed.len();

    let readme = read(&root().join("README.md"));
    let rows: Vec<String> = table(&readme, "drills")
        .iter()
        .map(|r| {
            ticks(&r[0]).first().map(|s| (*s).to_owned()).unwrap_or_else(|| panic!("drill row without a `name`: {r:?}"))
        })
        .collect();
    let mut documented = BTreeSet::new();
    for name in rows {
        assert!(documented.insert(name.clone()), "README's drill table has `{name}` twice");
    }
    assert_same("drills", &documented, &listed.into_iter().collect(), "`tandem drill --list`");

    let opening = &readme[..readme.find("\n## ").expect("README has sections")];
    assert!(!drill_counts(opening).is_empty(), "README's opening must say how many faults the drills rehearse");
    for (file, text) in docs() {
        for (stated, context) in drill_counts(&text) {
            assert_eq!(stated, n, "{file} says {stated} where `tandem drill --list` has {n} drills: \"{context}\"");
        }
    }
}

#[test]
fn every_documented_metric_is_exported_and_every_exported_metric_documented() {
    let mut exported = BTreeSet::new();
    for member in members() {
        for file in rust_files(&root().join(&member).join("src")) {
            for line in read(&file).lines() {
                let line = line.trim();
                if line.starts_with("pub const ") && line.contains(": &str = \"tandem_") {
                    exported.insert(line.split('"').nth(1).expect("a quoted name").to_owned());
                }
            }
        }
    }
    assert!(!exported.is_empty(), "found no `pub const NAME: &str = \"tandem_...\"` in any crate's src/");
    let mut documented = BTreeSet::new();
    for (_, text) in docs() {
        for (i, _) in text.match_indices("tandem_") {
            if text[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let len = text[i..]
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(text.len() - i);
            let name = &text[i..i + len];
            // Histogram series: `_bucket`, `_sum`, `_count` of an exported name.
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| exported.contains(*b));
            documented.insert(base.unwrap_or(name).to_owned());
        }
    }
    assert_same("metrics", &documented, &exported, "the exported name constants");
}

/// The error `code`s the coordinator's non-test sources can send: the
/// literal after an error type (`"overloaded_error", "queue_full"`, as
/// `ApiError::new` and the worker-error table write it), `with_code("..")`,
/// `code: Some("..")`, and the first argument of a helper `fn f(code: &'static str, ..)`.
fn coordinator_codes() -> BTreeSet<String> {
    let mut codes = BTreeSet::new();
    for file in rust_files(&root().join("coordinator/src")) {
        let text = read(&file).split_whitespace().collect::<Vec<_>>().join(" ");
        let text = text.split("#[cfg(test)] mod tests").next().unwrap_or_default();
        let helpers: Vec<String> = text
            .match_indices("(code: &'static str")
            .filter_map(|(i, _)| text[..i].rsplit("fn ").next().map(|f| format!("{f}(\"")))
            .collect();
        let mut after = |pattern: &str, call: bool| {
            for (i, _) in text.match_indices(pattern) {
                if call && text[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':' || c == '.') {
                    continue; // `Status::unavailable("..")`, `prefill_unavailable("..")`: not the helper
                }
                let literal = text[i + pattern.len()..].split('"').next().unwrap_or_default();
                if !literal.is_empty() && literal.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                    codes.insert(literal.to_owned());
                }
            }
        };
        for pattern in ["_error\", \"", "with_code(\"", "code: Some(\""] {
            after(pattern, false);
        }
        for helper in &helpers {
            after(helper, true);
        }
    }
    codes
}

#[test]
fn the_error_code_table_matches_the_codes_the_coordinator_sends() {
    let readme = read(&root().join("README.md"));
    let documented: BTreeSet<String> =
        table(&readme, "error-codes").iter().flat_map(|r| ticks(&r[1])).map(str::to_owned).collect();
    assert_same("error codes", &documented, &coordinator_codes(), "coordinator/src");
}

#[test]
fn the_coordinator_flag_table_matches_its_clap_flags() {
    let src = read(&root().join("coordinator/src/bin/tandem-coordinator.rs"));
    let start = src.find("struct Flags {").expect("tandem-coordinator.rs has `struct Flags {`");
    let body = &src[start..start + src[start..].find("\n}").expect("the end of struct Flags")];
    let mut flags = BTreeSet::new();
    let mut pending: Option<Option<String>> = None; // Some after `#[arg(long ..)]`: the explicit name, if any
    for line in body.lines().map(str::trim) {
        if line.starts_with("#[arg(") && line.contains("long") {
            pending = Some(line.split("long = \"").nth(1).and_then(|s| s.split('"').next()).map(str::to_owned));
        } else if let (Some(explicit), Some((field, _))) = (&pending, line.trim_start_matches("pub ").split_once(':')) {
            if !field.starts_with("//")
                && field.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                flags.insert(format!("--{}", explicit.clone().unwrap_or_else(|| field.replace('_', "-"))));
                pending = None;
            }
        }
    }
    assert!(!flags.is_empty(), "found no `#[arg(long ..)]` field in tandem-coordinator's Flags");
    let readme = read(&root().join("README.md"));
    let mut documented = BTreeSet::new();
    for row in table(&readme, "coordinator-flags") {
        for cell in &row {
            for tick in ticks(cell) {
                for word in
                    tick.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')).filter(|w| w.starts_with("--"))
                {
                    documented.insert(word.to_owned());
                }
            }
        }
    }
    assert_same("coordinator flags", &documented, &flags, "tandem-coordinator's Flags");
}

#[test]
fn every_crate_is_mapped_and_every_named_source_path_exists() {
    let readme = read(&root().join("README.md"));
    let map = &readme[readme.find("## Where things are").expect("README has `## Where things are`")..];
    for member in members() {
        assert!(
            map.contains(&format!("| `{member}/")),
            "README's `Where things are` has no row for the crate `{member}/`"
        );
    }
    let tops: Vec<String> =
        members().into_iter().chain(["config", "scripts", "docs", "fuzz"].map(String::from)).collect();
    for (file, text) in docs() {
        for tick in ticks(&prose(&text)) {
            // `a/{b,c}.rs` names a/b.rs and a/c.rs; other tokens are paths only if they look like one.
            let paths: Vec<String> =
                match tick.split_once('{').and_then(|(a, r)| r.split_once('}').map(|(m, z)| (a, m, z))) {
                    Some((a, mid, z)) => mid.split(',').map(|m| format!("{a}{m}{z}")).collect(),
                    None => vec![tick.to_owned()],
                };
            for path in paths {
                let top = path.split('/').next().unwrap_or_default();
                let last = path.rsplit('/').next().unwrap_or_default();
                let looks_like_path = path.contains('/') && (last.is_empty() || last.contains('.'));
                if looks_like_path && !path.contains([' ', '*']) && tops.iter().any(|t| t == top) {
                    assert!(root().join(&path).exists(), "{file} names `{path}`, which does not exist");
                }
            }
        }
    }
}

#[test]
fn the_tandem_up_flag_table_matches_tandem_up_help() {
    let out =
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(["up", "--help"]).output().expect("running tandem up --help");
    assert!(out.status.success(), "tandem up --help: {out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    // Option lines: `      --name <VALUE>` or `  -h, --help`.
    let flags: BTreeSet<String> = help
        .lines()
        .filter_map(|l| l.trim_start().trim_start_matches("-h, ").split_whitespace().next())
        .filter(|w| w.starts_with("--") && *w != "--help")
        .map(str::to_owned)
        .collect();
    assert!(flags.len() > 10, "found too few flags in tandem up --help: {flags:?}");
    let readme = read(&root().join("README.md"));
    let mut documented = BTreeSet::new();
    for row in table(&readme, "up-flags") {
        for tick in row.iter().flat_map(|cell| ticks(cell)) {
            documented.extend(
                tick.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                    .filter(|w| w.starts_with("--"))
                    .map(str::to_owned),
            );
        }
    }
    assert_same("tandem up flags", &documented, &flags, "tandem up --help");
}

/// The log lines a doc quotes: the backticked span right after "logs", "logs:", "log:",
/// "logged" or "line" (newlines read as spaces, as Markdown does).
fn quoted_log_lines(text: &str) -> Vec<String> {
    let flat = prose(text).replace('\n', " ");
    let mut out = Vec::new();
    for lead in ["logs `", "logs: `", "log: `", "logged `", "line `"] {
        let mut rest = flat.as_str();
        while let Some(i) = rest.find(lead) {
            rest = &rest[i + lead.len()..];
            if let Some(end) = rest.find('`') {
                out.push(rest[..end].to_owned());
                rest = &rest[end..];
            }
        }
    }
    out
}

#[test]
fn every_quoted_log_line_is_emitted_by_the_code() {
    // Product sources only: a test that prints the words proves nothing.
    let mut code = String::new();
    for member in members() {
        for f in rust_files(&root().join(&member).join("src")) {
            code.push_str(&read(&f));
        }
    }
    let mut docs = docs();
    let runbooks = root().join("docs/runbooks");
    for entry in std::fs::read_dir(&runbooks).expect("listing docs/runbooks") {
        let path = entry.expect("a runbook entry").path();
        let name = path.file_name().expect("a file name").to_string_lossy().into_owned();
        docs.push((format!("docs/runbooks/{name}"), read(&path)));
    }
    let (mut quoted, mut missing) = (0, Vec::new());
    for (file, text) in &docs {
        for line in quoted_log_lines(text) {
            quoted += 1;
            // `...` and capitalised words (`N`, `NAME`) stand for what varies; each literal
            // part must be in one message.
            let placeholder = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_uppercase());
            let literal: Vec<String> = line
                .split("...")
                .flat_map(|chunk| {
                    let mut parts = vec![String::new()];
                    for word in chunk.split(' ') {
                        if placeholder(word) {
                            parts.push(String::new());
                        } else if let Some(p) = parts.last_mut() {
                            p.push_str(word);
                            p.push(' ');
                        }
                    }
                    parts
                })
                .collect();
            for part in literal.iter().map(|p| p.trim()).filter(|p| p.len() >= 6) {
                if !code.contains(part) {
                    missing.push(format!("{file}: `{line}` (no source emits `{part}`)"));
                }
            }
        }
    }
    assert!(quoted >= 5, "the docs quote {quoted} log lines; the reader expects more of this check");
    assert!(missing.is_empty(), "log lines the docs quote that no source emits:\n{}", missing.join("\n"));
}
