//! deploy/ cannot drift from the code or rot unchecked:
//!
//! - Prometheus: `promtool check rules` / `check config` and `promtool test rules` pass;
//!   every alert has a firing unit test, a `runbook_url` naming docs/runbooks/<alert>.md
//!   (after the `runbook_base` external label, where one is set),
//!   and that page exists; every page has an alert and names only drills that
//!   `tandem drill --list` has; every `tandem_*` metric the rules or the Grafana dashboard
//!   query is an exported `pub const NAME: &str = "tandem_..."`, every non-target label
//!   matcher names a label and value the sources use, and every `tandem:*` series the
//!   dashboard reads is recorded by the rules.
//! - Kubernetes: `kubectl kustomize deploy/k8s/overlays/example` renders, the output
//!   validates against the Kubernetes schemas (`kubernetes-validate`, from the venv of
//!   scripts/python-deps.sh; CRDs such as ServiceMonitor and ScaledObject have no schema
//!   there and are skipped by it), and the manifests agree with the binaries: every flag
//!   in a container's args is in that binary's `--help`, every probe names a port the
//!   container declares and an HTTP path the process serves, the pod's grace period
//!   exceeds `--shutdown-timeout-ms`, and the version-group pod label equals
//!   `--version-group`.
//!
//! Tools missing (promtool, kubectl, the venv) fail the tests with how to get them; none
//! is skipped.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod manifests;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use manifests::{arg, args_of, containers, read, rendered, root, run_ok, venv_python, yaml_docs};

const RULES: &str = "deploy/prometheus/tandem-rules.yml";
const RULE_TESTS: &str = "deploy/prometheus/tests";
const DASHBOARD: &str = "deploy/grafana/tandem.json";
const RUNBOOKS: &str = "docs/runbooks";
/// Every `runbook_url` starts here: the Prometheus external label `runbook_base` (where
/// the docs are published) and a slash, or nothing (a path in the repository).
const RUNBOOK_BASE: &str = "{{ with $externalLabels.runbook_base }}{{ . }}/{{ end }}";

fn promtool() -> Command {
    Command::new(manifests::tool("promtool", "scripts/deps.sh installs Debian's `prometheus` package"))
}

/// Files of `dir` (relative to the root) whose name ends with `suffix`, sorted.
fn files(dir: &str, suffix: &str) -> Vec<PathBuf> {
    let dir = root().join(dir);
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    out.sort();
    out
}

/// The alerts of the rules file: name -> the `runbook_url`s of its rules (one per rule).
fn alerts() -> BTreeMap<String, Vec<String>> {
    let text = read(&root().join(RULES));
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("- alert:") {
            let name = name.trim().to_owned();
            out.entry(name.clone()).or_default();
            current = Some(name);
        } else if t.starts_with("- record:") {
            current = None;
        } else if let (Some(url), Some(name)) = (t.strip_prefix("runbook_url:"), &current) {
            out.get_mut(name).expect("entered above").push(url.trim().trim_matches(['"', '\'']).to_owned());
        }
    }
    assert!(!out.is_empty(), "{RULES} has no `- alert:`");
    out
}

/// `pub const NAME: &str = "tandem_..."` values in every workspace crate's src/.
fn exported_metrics() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for file in source_files() {
        for line in read(&file).lines() {
            let line = line.trim();
            if line.starts_with("pub const ") && line.contains(": &str = \"tandem_") {
                out.insert(line.split('"').nth(1).expect("a quoted name").to_owned());
            }
        }
    }
    assert!(!out.is_empty(), "found no `pub const NAME: &str = \"tandem_...\"` in any crate's src/");
    out
}

/// Every `.rs` file under each workspace member's src/.
fn source_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push(path);
            }
        }
    }
    let toml = read(&root().join("Cargo.toml"));
    let line = toml.lines().find(|l| l.trim_start().starts_with("members")).expect("a `members = [...]` line");
    let mut out = Vec::new();
    for member in line.split('"').skip(1).step_by(2) {
        walk(&root().join(member).join("src"), &mut out);
    }
    out
}

/// Every maximal `[a-z0-9_:]` token of `text` that starts with `prefix`.
fn tokens<'a>(text: &'a str, prefix: &str) -> BTreeSet<&'a str> {
    let word = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == ':';
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices(prefix) {
        if text[..i].ends_with(|c: char| word(c) || c.is_ascii_uppercase()) {
            continue;
        }
        let len = text[i..].find(|c: char| !word(c)).unwrap_or(text.len() - i);
        out.insert(&text[i..i + len]);
    }
    out
}

/// The metric names of `text` that are not exported constants (histogram series map to
/// their base name).
fn unknown_metrics(text: &str, exported: &BTreeSet<String>) -> Vec<String> {
    tokens(text, "tandem_")
        .into_iter()
        // A prefix in a regex or prose (`tandem_.+_total`) names no metric.
        .filter(|name| !name.ends_with('_'))
        .map(|name| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| exported.contains(*b))
                .unwrap_or(name)
        })
        .filter(|n| !exported.contains(*n))
        .map(str::to_owned)
        .collect()
}

#[test]
fn promtool_checks_the_rules_and_config_and_every_unit_test_passes() {
    run_ok(promtool().args(["check", "rules", RULES]), "promtool check rules");
    run_ok(promtool().args(["check", "config", "deploy/prometheus/prometheus.example.yml"]), "promtool check config");
    let tests = files(RULE_TESTS, ".yml");
    assert!(!tests.is_empty(), "no unit tests in {RULE_TESTS}");
    run_ok(promtool().args(["test", "rules"]).args(&tests), "promtool test rules");
}

#[test]
fn every_alert_has_a_firing_unit_test_and_its_runbook() {
    let alerts = alerts();
    // Alert names with at least one expected firing alert in some alert_rule_test.
    let mut fired = BTreeSet::new();
    for file in files(RULE_TESTS, ".yml") {
        let text = read(&file);
        let mut current = None;
        for line in text.lines() {
            let t = line.trim();
            if let Some(name) = t.strip_prefix("alertname:") {
                current = Some(name.trim().to_owned());
            } else if t.starts_with("- exp_labels:") {
                fired.extend(current.clone());
            }
        }
    }
    let mut problems = Vec::new();
    for (name, urls) in &alerts {
        if !fired.contains(name) {
            problems.push(format!("{name}: no unit test in {RULE_TESTS} expects it to fire"));
        }
        let page = format!("{RUNBOOKS}/{name}.md");
        let want = format!("{RUNBOOK_BASE}{page}");
        if urls.is_empty() || urls.iter().any(|u| *u != want) {
            problems.push(format!("{name}: runbook_url {urls:?}, want `{want}` on every rule"));
        }
        if !root().join(&page).is_file() {
            problems.push(format!("{name}: no runbook {want}"));
        }
    }
    let unknown: Vec<_> = fired.difference(&alerts.keys().cloned().collect()).cloned().collect();
    assert!(unknown.is_empty(), "unit tests name alerts the rules do not have: {unknown:?}");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_runbook_has_an_alert_and_names_only_real_drills() {
    let alerts = alerts();
    let out =
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(["drill", "--list"]).output().expect("run tandem drill --list");
    assert!(out.status.success(), "tandem drill --list failed: {}", String::from_utf8_lossy(&out.stderr));
    let drills: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(!drills.is_empty(), "tandem drill --list printed no drill");
    let index = read(&root().join(RUNBOOKS).join("README.md"));
    let mut problems = Vec::new();
    for page in files(RUNBOOKS, ".md") {
        let name = page.file_stem().expect("a file name").to_string_lossy().into_owned();
        if name == "README" {
            continue;
        }
        if !alerts.contains_key(&name) {
            problems.push(format!("{RUNBOOKS}/{name}.md has no alert of that name in {RULES}"));
        }
        let text = read(&page);
        if !text.starts_with(&format!("# {name}\n")) {
            problems.push(format!("{name}.md does not start with `# {name}`"));
        }
        let Some(rehearsed) = text.split("## Rehearsed by").nth(1) else {
            problems.push(format!("{name}.md has no `## Rehearsed by` section"));
            continue;
        };
        let rehearsed = rehearsed.split("\n## ").next().unwrap_or_default();
        // "Drill `x`" / "drill `x`": each must exist; a page without one says "None".
        let named: Vec<&str> =
            rehearsed.split("rill `").skip(1).map(|s| s.split('`').next().unwrap_or_default()).collect();
        if named.is_empty() && !rehearsed.trim_start().starts_with("None") {
            problems.push(format!("{name}.md: `Rehearsed by` names no drill and does not say None"));
        }
        for d in named {
            if !drills.contains(d) {
                problems.push(format!("{name}.md names drill `{d}`, which `tandem drill --list` does not have"));
            }
        }
    }
    for name in alerts.keys() {
        if !index.contains(&format!("[{name}.md]({name}.md)")) {
            problems.push(format!("{RUNBOOKS}/README.md does not link {name}.md"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_rules_query_only_exported_metrics_and_labels_the_code_sets() {
    let exported = exported_metrics();
    let rules = read(&root().join(RULES));
    let unknown = unknown_metrics(&rules, &exported);
    assert!(unknown.is_empty(), "{RULES} queries metrics no crate exports: {unknown:?}");

    // Label matchers other than the target labels and `le` must name a label the code
    // sets (`"label" =>`) and a value it uses (`"value"` in some source).
    let sources: String = source_files().iter().map(|f| read(f)).collect();
    let target_labels = ["role", "component", "version_group", "job", "instance", "le", "__name__"];
    let mut problems = Vec::new();
    for expr_line in rules.lines().filter(|l| !l.trim_start().starts_with('#')) {
        for (i, _) in expr_line.match_indices('{') {
            let Some(end) = expr_line[i..].find('}') else { continue };
            for matcher in expr_line[i + 1..i + end].split(',') {
                let Some((label, value)) = matcher.split_once('=') else { continue };
                let (label, value) = (label.trim().trim_end_matches('!'), value.trim_start_matches(['~', '=']));
                let value = value.trim().trim_matches('"');
                if label.is_empty() || label.contains(['$', ' ', '.']) || target_labels.contains(&label) {
                    continue;
                }
                if !sources.contains(&format!("\"{label}\" =>")) {
                    problems.push(format!("label `{label}` (in `{}`) is set by no source", matcher.trim()));
                }
                // A status code or class (`200`, `5..`) is a number the code formats, not a
                // string literal it names.
                let numeric = !value.is_empty() && value.chars().all(|c| c.is_ascii_digit() || c == '.');
                if !numeric && !sources.contains(&format!("\"{value}\"")) {
                    problems.push(format!("value `{value}` of `{label}` is used by no source"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The series names recorded by the rules (`- record: NAME`).
fn recorded() -> BTreeSet<String> {
    read(&root().join(RULES))
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record:"))
        .map(|n| n.trim().to_owned())
        .collect()
}

#[test]
fn the_dashboard_queries_only_exported_metrics_and_recorded_series() {
    let text = read(&root().join(DASHBOARD));
    let dash: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"));
    let panels = dash["panels"].as_array().unwrap_or_else(|| panic!("{DASHBOARD} has no `panels`"));
    let (exported, recorded) = (exported_metrics(), recorded());
    let mut problems = Vec::new();
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        if !ids.insert(p["id"].as_u64().unwrap_or_else(|| panic!("panel `{title}` has no numeric id"))) {
            problems.push(format!("panel `{title}`: duplicate id {}", p["id"]));
        }
        if p["type"] == "row" {
            continue;
        }
        if p["datasource"]["uid"] != "${datasource}" {
            problems.push(format!("panel `{title}`: datasource is not the ${{datasource}} variable"));
        }
        let targets = p["targets"].as_array().map(Vec::as_slice).unwrap_or_default();
        if targets.is_empty() {
            problems.push(format!("panel `{title}` has no query"));
        }
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_default();
            queries += 1;
            for m in unknown_metrics(expr, &exported) {
                problems.push(format!("panel `{title}` queries `{m}`, which no crate exports"));
            }
            for r in tokens(expr, "tandem:") {
                if !recorded.contains(r) {
                    problems.push(format!("panel `{title}` reads `{r}`, which {RULES} does not record"));
                }
            }
        }
    }
    assert!(queries > 0, "{DASHBOARD} has no query");
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // Every query parses as PromQL: promtool checks them as recording rules, with
    // Grafana's variables replaced by what they expand to.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in panels.iter().flat_map(|p| p["targets"].as_array().into_iter().flatten()).enumerate() {
        let expr = expr["expr"].as_str().unwrap_or_default();
        let expr = expr.replace("$__rate_interval", "5m").replace("$version_group", ".*");
        rules.push_str(&format!("      - record: dashboard:q{i}\n        expr: {}\n", serde_json::Value::from(expr)));
    }
    let file = std::env::temp_dir().join(format!("tandem-dashboard-rules-{}.yml", std::process::id()));
    std::fs::write(&file, rules).expect("writing the dashboard's queries");
    let checked = promtool().args(["check", "rules"]).arg(&file).current_dir(root()).output();
    let _ = std::fs::remove_file(&file);
    let out = checked.expect("run promtool");
    assert!(
        out.status.success(),
        "a dashboard query is not valid PromQL:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---- Kubernetes ------------------------------------------------------------------------

const VERSION_GROUP_LABEL: &str = "tandem.io/version-group";

/// The long flags a binary's `--help` lists.
fn help_flags(binary: &Path) -> BTreeSet<String> {
    let flags: BTreeSet<String> = help_defaults(binary, &[]).into_keys().collect();
    assert!(!flags.is_empty(), "{} --help listed no flag", binary.display());
    flags
}

/// The port of `host:port` (`$(POD_IP):7000` too).
fn port_of(addr: &str) -> u64 {
    addr.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no port in `{addr}`"))
}

/// The HTTP paths a real coordinator answers other than 404, among `paths`.
fn coordinator_serves(paths: &BTreeSet<String>) -> BTreeSet<String> {
    let model = engine::paths::default_model_path();
    assert!(model.is_file(), "test model {} not found: run `make model`", model.display());
    let bin = Path::new(env!("CARGO_BIN_EXE_tandem")).with_file_name("tandem-coordinator");
    // Fixed addresses of no worker: it starts, is alive, and is not ready.
    let coordinator = opskit::process::Launch::path(&bin)
        .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--decode", "127.0.0.1:9"])
        .arg("--model")
        .arg(model.to_string_lossy())
        .wants(&["http"])
        .start_blocking()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let addr = coordinator.addr("http").expect("the coordinator printed `listening http=`");
    let status = |p: &str| {
        opskit::http::blocking::status(&addr, p, std::time::Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("GET {p}: {e}"))
    };
    paths.iter().filter(|p| status(p) != 404).cloned().collect()
}

#[test]
fn the_example_overlay_renders_and_validates_against_the_kubernetes_schemas() {
    let yaml = rendered();
    let file = std::env::temp_dir().join(format!("tandem-k8s-{}.yaml", std::process::id()));
    std::fs::write(&file, &yaml).expect("write the rendered manifests");
    let validator = venv_python().with_file_name("kubernetes-validate");
    let out = Command::new(&validator)
        .args(["--strict", "--kubernetes-version", "1.32.0"])
        .arg(&file)
        .arg(root().join("deploy/k8s/alternatives/hpa-decode.yaml"))
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/python-deps.sh installs it)", validator.display()));
    let _ = std::fs::remove_file(&file);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "kubernetes-validate failed:\n{text}");
    // Only the CRDs (no schema in kubernetes-validate) may go unchecked.
    for line in text.lines().filter(|l| l.contains("Couldn't find schema")) {
        assert!(
            ["ServiceMonitor", "PrometheusRule", "ScaledObject"].iter().any(|k| line.contains(&format!("kind {k} "))),
            "unexpected unvalidated resource: {line}"
        );
    }
    let docs = yaml_docs(&yaml);
    let kinds: BTreeSet<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for want in [
        "StatefulSet",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "ScaledObject",
        "PrometheusRule",
    ] {
        assert!(kinds.contains(want), "the example overlay renders no {want}");
    }
    let unknown = unknown_metrics(&yaml, &exported_metrics());
    assert!(unknown.is_empty(), "the manifests name metrics no crate exports: {unknown:?}");
}

#[test]
fn the_overlay_pins_the_tandem_image_by_digest() {
    let docs = yaml_docs(&rendered());
    let mut tandem = 0;
    for (name, _, c) in containers(&docs) {
        let image = c["image"].as_str().unwrap_or_default();
        let Some((repo, digest)) = image.split_once("@sha256:") else { continue };
        tandem += usize::from(repo.rsplit('/').next() == Some("tandem"));
        assert!(!repo.rsplit('/').next().unwrap_or_default().contains(':'), "{name}: a tag beside the digest: {image}");
        assert!(
            digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
            "{name}: `{digest}` is not a sha256 digest"
        );
    }
    let unpinned: Vec<String> = containers(&docs)
        .into_iter()
        .filter(|(_, _, c)| c["image"].as_str().is_some_and(|i| !i.contains('@') && i.contains("tandem")))
        .map(|(n, _, c)| format!("{n}: {}", c["image"]))
        .collect();
    assert!(unpinned.is_empty(), "the tandem image by tag, not digest: {unpinned:?}");
    assert!(tandem >= 3, "coordinator, prefill and decode run the tandem image by digest: {tandem} do");
}

#[test]
fn the_prometheusrule_is_the_rules_file() {
    let rules = read(&root().join(RULES));
    let groups = &rules[rules.find("\ngroups:").expect("`groups:` in the rules file") + 1..];
    let cr = read(&root().join("deploy/k8s/base/prometheusrule.yaml"));
    let spec = &cr[cr.find("\nspec:\n").expect("`spec:` in prometheusrule.yaml") + 7..];
    let dedented: String = spec.lines().map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l))).collect();
    assert!(
        dedented == groups,
        "deploy/k8s/base/prometheusrule.yaml differs from {RULES}: regenerate it (the command is in its header)"
    );
}

#[test]
fn the_manifests_agree_with_the_binaries() {
    let docs = yaml_docs(&rendered());
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_tandem")).parent().expect("target dir").to_path_buf();
    let mut problems = Vec::new();
    let mut coordinator_paths = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for d in &docs {
        let kind = d["kind"].as_str().unwrap_or_default();
        if kind != "Deployment" && kind != "StatefulSet" {
            continue;
        }
        let name = d["metadata"]["name"].as_str().unwrap_or("?").to_owned();
        let pod = &d["spec"]["template"];
        let grace = pod["spec"]["terminationGracePeriodSeconds"].as_f64();
        for c in pod["spec"]["containers"].as_array().into_iter().flatten() {
            let binary = c["command"][0].as_str().unwrap_or_default().to_owned();
            let at = format!("{name}/{}", c["name"].as_str().unwrap_or("?"));
            let exe = if binary == "etcd" {
                PathBuf::from("etcd")
            } else {
                assert!(binary.starts_with("tandem-"), "{at}: command `{binary}` is not a tandem binary");
                bin_dir.join(&binary)
            };
            seen.insert(binary.clone());
            let known = help_flags(&exe);
            let args = args_of(c);
            for (flag, _) in &args {
                if !known.contains(flag) {
                    problems.push(format!("{at}: `{flag}` is not a flag of `{binary} --help`"));
                }
            }
            // Named ports and their numbers, and the flag that binds each.
            let ports: BTreeMap<String, u64> = c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| (p["name"].as_str().unwrap_or_default().to_owned(), p["containerPort"].as_u64().unwrap_or(0)))
                .collect();
            let bound = [("http", "--http"), ("grpc", "--grpc"), ("metrics", "--metrics"), ("transfer", "--transfer")];
            for (port, flag) in bound {
                if let (Some(n), Some(addr)) = (ports.get(port), arg(&args, flag)) {
                    if port_of(addr) != *n {
                        problems.push(format!("{at}: port `{port}` is {n} but {flag}={addr}"));
                    }
                }
            }
            // Probes: a declared port, a path the process serves.
            for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                let p = &c[probe];
                if p.is_null() {
                    if binary != "etcd" || probe != "startupProbe" {
                        problems.push(format!("{at}: no {probe}"));
                    }
                    continue;
                }
                let port = p["httpGet"]["port"].clone();
                let port = if port.is_null() { p["tcpSocket"]["port"].clone() } else { port };
                let port = if port.is_null() { p["grpc"]["port"].clone() } else { port };
                if !p["exec"].is_null() {
                    problems.push(format!("{at}: {probe} runs a command: the image has no shell, use httpGet or grpc"));
                }
                if !p["grpc"].is_null() && binary == "tandem-coordinator" {
                    problems
                        .push(format!("{at}: {probe} is grpc: the coordinator's probes are HTTP /ready and /health"));
                }
                if let Some(port) = port.as_str() {
                    if !ports.contains_key(port) {
                        problems
                            .push(format!("{at}: {probe} names port `{port}`, which the container does not declare"));
                    }
                } else if let Some(n) = port.as_u64() {
                    if !ports.values().any(|v| *v == n) {
                        problems.push(format!("{at}: {probe} port {n} is not a container port"));
                    }
                }
                let path = p["httpGet"]["path"].as_str();
                match (binary.as_str(), path) {
                    ("tandem-coordinator", Some(path)) => {
                        coordinator_paths.insert(path.to_owned());
                        let want = if probe == "readinessProbe" { "/ready" } else { "/health" };
                        if path != want {
                            problems.push(format!(
                                "{at}: {probe} is {path}; it must be {want} (README: Health and readiness)"
                            ));
                        }
                    }
                    ("tandem-prefill-worker" | "tandem-decode-worker", Some(path)) if path != "/metrics" => {
                        problems.push(format!("{at}: {probe} path {path}: workers serve HTTP only on /metrics"));
                    }
                    _ => {}
                }
                // A worker's readiness is grpc.health.v1 on its gRPC port (SERVING = not
                // fenced, not draining); /metrics answers while it is fenced.
                let worker = binary == "tandem-prefill-worker" || binary == "tandem-decode-worker";
                if worker && probe == "readinessProbe" && p["grpc"]["port"].as_u64() != ports.get("grpc").copied() {
                    problems
                        .push(format!("{at}: readinessProbe must be grpc on the gRPC port {:?}", ports.get("grpc")));
                }
            }
            if binary == "etcd" {
                continue;
            }
            // Drain: the kubelet's SIGTERM starts it (a preStop may only `sleep`: no shell);
            // the grace outlasts the sleep and the drain.
            let pre_stop = &c["lifecycle"]["preStop"];
            if !pre_stop.is_null() && pre_stop["sleep"].is_null() {
                problems.push(format!("{at}: preStop {pre_stop} is not a `sleep` action (the image has no shell)"));
            }
            let slept = pre_stop["sleep"]["seconds"].as_f64().unwrap_or(0.0);
            let timeout_ms: f64 = arg(&args, "--shutdown-timeout-ms").and_then(|v| v.parse().ok()).unwrap_or(10_000.0);
            if binary == "tandem-coordinator" {
                // The drain outlasts the longest request, so a rollout cuts no answer.
                let longest: Option<f64> = arg(&args, "--max-request-timeout-ms").and_then(|v| v.parse().ok());
                if !longest.is_some_and(|l| l > 0.0 && timeout_ms > l) {
                    problems.push(format!(
                        "{at}: --shutdown-timeout-ms {timeout_ms} must exceed --max-request-timeout-ms {longest:?} (set)"
                    ));
                }
                if arg(&args, "--tenants").is_none() && arg(&args, "--api-keys-file").is_none() {
                    problems.push(format!("{at}: neither --tenants nor --api-keys-file: the API would be open"));
                }
            }
            match grace {
                Some(g) if g > slept + timeout_ms / 1000.0 => {}
                g => problems.push(format!(
                    "{at}: terminationGracePeriodSeconds {g:?} must exceed the preStop sleep {slept} s + \
                     --shutdown-timeout-ms {timeout_ms} ms"
                )),
            }
            // Workers: the version-group label of the pod (and the selector) is the worker's group.
            if binary != "tandem-coordinator" {
                let group = arg(&args, "--version-group");
                let label = pod["metadata"]["labels"][VERSION_GROUP_LABEL].as_str();
                let selector = d["spec"]["selector"]["matchLabels"][VERSION_GROUP_LABEL].as_str();
                if group.is_none() || label != group || selector != group {
                    problems.push(format!(
                        "{at}: --version-group {group:?}, pod label {VERSION_GROUP_LABEL} {label:?}, selector {selector:?}"
                    ));
                }
            }
        }
    }
    for want in ["tandem-coordinator", "tandem-prefill-worker", "tandem-decode-worker", "etcd"] {
        assert!(seen.contains(want), "no container runs {want}");
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let served = coordinator_serves(&coordinator_paths);
    let missing: Vec<_> = coordinator_paths.difference(&served).collect();
    assert!(missing.is_empty(), "the coordinator answers 404 on probe paths {missing:?}");
}

/// Whether a NetworkPolicy's `podSelector.matchLabels` selects a pod with `labels`.
fn selects(policy: &serde_json::Value, labels: &serde_json::Value) -> bool {
    let want = policy["spec"]["podSelector"]["matchLabels"].as_object();
    want.is_some_and(|w| w.iter().all(|(k, v)| labels[k] == *v))
}

#[test]
fn every_workload_is_locked_down_sized_and_every_port_has_a_network_policy() {
    let docs = yaml_docs(&rendered());
    let policies: Vec<&serde_json::Value> =
        docs.iter().filter(|d| d["kind"].as_str() == Some("NetworkPolicy")).collect();
    let mut problems = Vec::new();
    let all = containers(&docs);
    assert!(all.len() >= 4, "coordinator, prefill, decode and etcd containers: found {}", all.len());
    for (name, pod, c) in all {
        let at = format!("{name}/{}", c["name"].as_str().unwrap_or("?"));
        let spec = &pod["spec"];
        // Least privilege: a non-root user, the runtime's seccomp profile, no API token,
        // a read-only root, no capabilities, no privilege escalation.
        let pod_sec = &spec["securityContext"];
        if pod_sec["runAsNonRoot"] != true || pod_sec["seccompProfile"]["type"] != "RuntimeDefault" {
            problems.push(format!("{at}: pod securityContext {pod_sec} (runAsNonRoot, seccomp RuntimeDefault)"));
        }
        if spec["automountServiceAccountToken"] != false || spec["serviceAccountName"].is_null() {
            problems.push(format!("{at}: a service account of its own, with no API token mounted"));
        }
        let sec = &c["securityContext"];
        let drops_all = sec["capabilities"]["drop"].as_array().is_some_and(|d| d.iter().any(|x| x == "ALL"));
        if sec["readOnlyRootFilesystem"] != true || sec["allowPrivilegeEscalation"] != false || !drops_all {
            problems.push(format!("{at}: container securityContext {sec}"));
        }
        // Sized: requests for CPU and memory; workers Guaranteed (requests = limits).
        let (req, lim) = (&c["resources"]["requests"], &c["resources"]["limits"]);
        if req["cpu"].is_null() || req["memory"].is_null() || lim["memory"].is_null() {
            problems.push(format!("{at}: resources {} (cpu and memory requests, a memory limit)", c["resources"]));
        }
        let command = c["command"][0].as_str().unwrap_or_default();
        if command.ends_with("-worker") && (req["cpu"] != lim["cpu"] || req["memory"] != lim["memory"]) {
            problems.push(format!("{at}: a worker must be Guaranteed (requests = limits): {}", c["resources"]));
        }
        // Every port some NetworkPolicy selecting this pod admits (by name or number).
        let labels = &pod["metadata"]["labels"];
        let selecting: Vec<_> = policies.iter().filter(|p| selects(p, labels)).collect();
        if !selecting.iter().any(|p| p["spec"]["ingress"].is_null()) {
            problems.push(format!("{at}: no default-deny NetworkPolicy selects it"));
        }
        for port in c["ports"].as_array().into_iter().flatten() {
            let (pname, number) = (&port["name"], &port["containerPort"]);
            let admitted = selecting.iter().any(|p| {
                p["spec"]["ingress"].as_array().into_iter().flatten().any(|rule| {
                    rule["ports"].as_array().into_iter().flatten().any(|q| q["port"] == *pname || q["port"] == *number)
                })
            });
            if !admitted {
                problems.push(format!("{at}: port {pname} ({number}) has no NetworkPolicy rule"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Each flag `--help` lists, with its default where it states one: clap's
/// `[default: X]`, or the doc text's `Default X` (flags that are `Option`s resolved later
/// say it that way).
fn help_defaults(binary: &Path, args: &[&str]) -> BTreeMap<String, Option<String>> {
    let out =
        Command::new(binary).args(args).arg("--help").output().unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(flag) = t.split_whitespace().find(|w| w.starts_with("--")) {
            if t.starts_with('-') {
                let flag: String = flag.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
                out.entry(flag.clone()).or_insert(None);
                current = Some(flag);
            }
        }
        let Some(flag) = &current else { continue };
        let value = t
            .split_once("[default: ")
            .map(|(_, v)| v.split(']').next().unwrap_or_default())
            .or_else(|| t.split_once("Default ").map(|(_, v)| v.split([' ', '.', ',']).next().unwrap_or_default()));
        if let Some(v) = value.filter(|v| !v.is_empty()) {
            out.entry(flag.clone()).or_insert(None).get_or_insert_with(|| v.to_owned());
        }
    }
    out
}

/// A runbook (and the operations page, which they link) names only flags some tandem
/// program has, and where it says a flag's default (`` `--x-ms` (default 5000) ``,
/// `(default 30 s)`, `(10 s by default)`), the program's `--help` says the same.
#[test]
fn runbooks_name_real_flags_and_their_defaults() {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_tandem")).parent().expect("target dir").to_path_buf();
    let programs: Vec<(PathBuf, Vec<&str>)> = vec![
        (bin_dir.join("tandem-coordinator"), vec![]),
        (bin_dir.join("tandem-prefill-worker"), vec![]),
        (bin_dir.join("tandem-decode-worker"), vec![]),
        (bin_dir.join("tandem"), vec!["up"]),
        (bin_dir.join("tandem"), vec!["drill"]),
        (bin_dir.join("tandem"), vec!["chaos"]),
        // The lost-member procedure passes etcd's own flags.
        (PathBuf::from("etcd"), vec![]),
    ];
    let mut known: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (exe, sub) in &programs {
        for (flag, default) in help_defaults(exe, sub) {
            known.entry(flag).or_default().extend(default);
        }
    }
    let mut pages = vec![("docs/operations.md".to_owned(), read(&root().join("docs/operations.md")))];
    for entry in std::fs::read_dir(root().join(RUNBOOKS)).expect("listing the runbooks") {
        let path = entry.expect("a runbook").path();
        pages.push((path.display().to_string(), read(&path)));
    }
    let (mut checked, mut problems) = (0, Vec::new());
    for (page, text) in &pages {
        let flat = text.replace('\n', " ");
        for (i, _) in flat.match_indices("`--") {
            let rest = &flat[i + 1..];
            let Some(end) = rest.find('`') else { continue };
            let flag: String = rest[..end].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
            let Some(defaults) = known.get(&flag) else {
                problems.push(format!("{page}: `{flag}` is a flag of no tandem program"));
                continue;
            };
            // The default the page states right after the flag, in the flag's unit.
            let after: String = rest[end + 1..].chars().take(40).collect();
            let stated = after.trim_start().strip_prefix("(default ").map(|v| v.to_owned()).or_else(|| {
                after.trim_start().strip_prefix('(').filter(|v| v.contains(" by default")).map(str::to_owned)
            });
            let Some(stated) = stated else { continue };
            let mut words = stated.split([' ', ',', ')']).filter(|w| !w.is_empty());
            let (Some(number), unit) = (words.next(), words.next()) else { continue };
            let Ok(n) = number.parse::<f64>() else { continue };
            let in_flag_unit = match (flag.ends_with("-ms"), unit) {
                (true, Some("s")) => n * 1000.0,
                (true, Some("min")) => n * 60_000.0,
                _ => n,
            };
            checked += 1;
            if !defaults.iter().any(|d| d.parse::<f64>().is_ok_and(|d| d == in_flag_unit)) {
                problems.push(format!("{page}: `{flag}` default stated {stated:?}, --help says {defaults:?}"));
            }
        }
    }
    assert!(checked >= 5, "only {checked} stated defaults found: the parser lost them");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
