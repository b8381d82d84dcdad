//! The images `make image` builds run the Kubernetes pack as shipped. From the OCI layouts
//! in target/image (or `$TANDEM_IMAGE_DIR`), unpacked with umoci and run with runc:
//!
//! - etcd from the etcd image, single member, with the pack's compaction and quota flags;
//! - every container of the rendered example overlay that runs the `tandem` image (the
//!   prefill worker, the decode worker, the coordinator) with its exact command and
//!   args — addresses moved to free loopback ports and `--etcd` to the test's — and as
//!   its pod says: the securityContext's user, a read-only root, no capabilities, no new
//!   privileges, and its volumes (the model read-only at /models, the tenants Secret's
//!   file, an emptyDir /tmp). Host network, so the test reaches them on loopback.
//!
//! The cluster serves a chat completion for the overlay's API key and refuses a request
//! without one; each binary runs as PID 1 of its container as the pod's user, with a
//! read-only root and no effective capability, and stops on SIGTERM with status 0 (PID 1
//! gets no default signal handling: a binary without its own would hang every rollout
//! until the kubelet's SIGKILL).
//!
//! Needs root, umoci and runc (scripts/deps.sh) and the images (`make image`, which
//! `make test` runs first); missing, the test fails saying so, never skips.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod manifests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use facts::metrics::coordinator::PREFILL_ATTEMPTS;
use manifests::{containers, read, rendered, root, run_ok, yaml_docs};
use opskit::process::{Launch, Proc};
use serde_json::{json, Value};

/// Bound on a process becoming ready, a request, and a stop (a loaded 2-core machine).
const WAIT: Duration = Duration::from_secs(180);

fn image_dir() -> PathBuf {
    let dir = std::env::var_os("TANDEM_IMAGE_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target/image"));
    for layout in ["tandem", "etcd"] {
        assert!(
            dir.join(layout).join("index.json").is_file(),
            "no OCI layout at {}: run `make image` (or set TANDEM_IMAGE_DIR)",
            dir.join(layout).display()
        );
    }
    dir
}

fn tool(name: &str) -> PathBuf {
    manifests::tool(name, "scripts/deps.sh installs umoci and runc")
}

/// The image was built from this tree: its revision label is `git rev-parse HEAD` (with
/// `-dirty` when the tree has uncommitted changes, as scripts/build-image.sh writes it).
/// A stale image would test old binaries against today's manifests.
fn image_is_of_this_tree(layout: &Path) {
    let git = |args: &[&str]| Command::new("git").arg("-C").arg(root()).args(args).output().expect("git");
    let head = String::from_utf8_lossy(&git(&["rev-parse", "HEAD"]).stdout).trim().to_owned();
    let dirty = !git(&["diff", "--quiet", "HEAD"]).status.success();
    let want = if dirty { format!("{head}-dirty") } else { head };
    let blob = |digest: &str| {
        let path = layout.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
        serde_json::from_str::<Value>(&read(&path)).expect("an OCI JSON blob")
    };
    let manifest = blob(index(layout)["manifests"][0]["digest"].as_str().expect("a manifest digest"));
    let config = blob(manifest["config"]["digest"].as_str().expect("a config digest"));
    let revision = config["config"]["Labels"]["org.opencontainers.image.revision"].as_str().unwrap_or_default();
    assert_eq!(revision, want, "{} is of another tree: run `make image`", layout.display());
}

/// An OCI layout's index.json.
fn index(layout: &Path) -> Value {
    serde_json::from_str(&read(&layout.join("index.json"))).expect("index.json is JSON")
}

/// The one tag of an OCI layout.
fn only_tag(layout: &Path) -> String {
    let index = index(layout);
    let tags: Vec<&str> = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["annotations"]["org.opencontainers.image.ref.name"].as_str())
        .collect();
    assert_eq!(tags.len(), 1, "{}: one tag expected, found {tags:?}", layout.display());
    tags[0].to_owned()
}

/// `umoci unpack` of a layout's tag into `bundle`: its runtime config (config.json).
fn unpack(layout: &Path, bundle: &Path) -> Value {
    let image = format!("{}:{}", layout.display(), only_tag(layout));
    run_ok(Command::new(tool("umoci")).arg("unpack").arg("--image").arg(&image).arg(bundle), "umoci unpack");
    serde_json::from_str(&read(&bundle.join("config.json"))).expect("umoci's config.json")
}

/// How one container runs: what the OCI config says beyond the image's.
struct Spec {
    name: String,
    args: Vec<String>,
    uid: u64,
    gid: u64,
    readonly: bool,
    mounts: Vec<Value>,
    /// `NAME=value` added to the image's environment (the container's `env`).
    env: Vec<String>,
}

fn bind(source: &Path, destination: &str) -> Value {
    json!({"destination": destination, "type": "bind", "source": source, "options": ["rbind", "ro"]})
}

fn tmpfs(destination: &str) -> Value {
    json!({"destination": destination, "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777", "size=64m"]})
}

/// The image's runtime config, made to run `spec`: no network namespace (host network),
/// no capability, no new privileges.
fn oci_config(image: &Value, spec: &Spec) -> Value {
    let mut c = image.clone();
    c["process"]["args"] = json!(spec.args);
    let env = c["process"]["env"].as_array_mut().expect("the image config has an environment");
    env.extend(spec.env.iter().map(|e| json!(e)));
    c["process"]["terminal"] = json!(false);
    c["process"]["user"] = json!({"uid": spec.uid, "gid": spec.gid});
    c["process"]["noNewPrivileges"] = json!(true);
    c["process"]["capabilities"] =
        json!({"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []});
    c["root"] = json!({"path": "rootfs", "readonly": spec.readonly});
    if let Some(ns) = c["linux"]["namespaces"].as_array_mut() {
        ns.retain(|n| n["type"] != "network");
    }
    let mounts = c["mounts"].as_array_mut().expect("the image config has mounts");
    mounts.extend(spec.mounts.iter().cloned());
    c
}

/// The containers this test started under its own runc state directory; dropping it
/// deletes them all (killed first), so a failing test leaves nothing running.
struct Runc {
    runc: PathBuf,
    state: PathBuf,
    dir: PathBuf,
    started: Vec<String>,
}

impl Runc {
    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.runc);
        c.arg("--root").arg(&self.state);
        c
    }

    /// `runc run` of `spec` over the root of `bundle` (an unpacked image), in a bundle of
    /// its own (its config.json), waiting for its `listening NAME=` lines.
    fn run(&mut self, bundle: &Path, image: &Value, spec: &Spec, wants: &[&str]) -> Proc {
        let own = self.dir.join("bundles").join(&spec.name);
        std::fs::create_dir_all(&own).expect("bundle dir");
        let mut config = oci_config(image, spec);
        config["root"]["path"] = json!(bundle.join("rootfs"));
        std::fs::write(own.join("config.json"), serde_json::to_vec_pretty(&config).expect("JSON"))
            .expect("config.json");
        self.started.push(spec.name.clone());
        Launch::path(&self.runc)
            .name(&spec.name)
            .arg("--root")
            .arg(self.state.to_string_lossy())
            .args(["run", "--bundle"])
            .arg(own.to_string_lossy())
            .arg(&spec.name)
            .wants(wants)
            .log_dir(&self.dir)
            .wait(WAIT)
            .start_blocking()
            .unwrap_or_else(|e| panic!("{} under runc: {e}", spec.name))
    }

    /// The host pid of a container's first process (the binary, PID 1 inside).
    fn pid(&self, name: &str) -> u32 {
        let out = self.cmd().args(["state", name]).output().expect("runc state");
        assert!(out.status.success(), "runc state {name}: {}", String::from_utf8_lossy(&out.stderr));
        let state: Value = serde_json::from_slice(&out.stdout).expect("runc state is JSON");
        state["pid"].as_u64().and_then(|p| u32::try_from(p).ok()).expect("a pid in runc state")
    }
}

impl Drop for Runc {
    fn drop(&mut self) {
        for name in &self.started {
            let _ = self.cmd().args(["delete", "--force", name]).output();
        }
    }
}

/// Each run's directory under the temporary directory: `PREFIX<pid of the test>`.
const RUN_PREFIX: &str = "tandem-image-";

/// A run killed before its `Drop` (a test runner's timeout) leaves containers running on
/// the host network and an unpacked root: delete both for every run whose process is
/// gone.
fn reap_killed_runs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    let runc = tool("runc");
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(RUN_PREFIX).and_then(|p| p.parse::<u32>().ok()) else { continue };
        // Gone, or a zombie nobody reaped yet (its containers outlive it all the same).
        let alive = !matches!(opskit::process::proc_state(pid), None | Some('Z'));
        if pid == std::process::id() || alive {
            continue;
        }
        let state = e.path().join("runc");
        let list = Command::new(&runc).arg("--root").arg(&state).args(["list", "-q"]).output();
        for id in
            list.iter().flat_map(|o| String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).collect::<Vec<_>>())
        {
            let _ = Command::new(&runc).arg("--root").arg(&state).args(["delete", "--force", &id]).output();
        }
        let _ = std::fs::remove_dir_all(e.path());
    }
}

/// `/proc/PID/status`'s `Key:` line, its value.
fn status_field(pid: u32, key: &str) -> String {
    let status = read(Path::new(&format!("/proc/{pid}/status")));
    let line =
        status.lines().find(|l| l.starts_with(&format!("{key}:"))).unwrap_or_else(|| panic!("no {key} in status"));
    line[key.len() + 1..].trim().to_owned()
}

/// The mount options of `/` as process `pid` sees it.
fn root_mount_options(pid: u32) -> String {
    let info = read(Path::new(&format!("/proc/{pid}/mountinfo")));
    // Fields: id parent major:minor root mountpoint options ...; the last `/` mount wins.
    let mut options = info.lines().filter_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.get(4) == Some(&"/")).then(|| f.get(5).map(|o| (*o).to_owned())).flatten()
    });
    options.next_back().expect("a mount at / in mountinfo")
}

/// Polls `GET path` on `addr` until it answers 200; an error (with every process's log
/// tail) when one of `procs` exits first or [`WAIT`] passes.
fn answers_200(addr: &str, path: &str, procs: &mut [Proc]) -> Result<(), String> {
    let waited = opskit::wait::blocking::poll(&format!("GET {path} on {addr} answers 200"), WAIT, || {
        if let Some((tail, status)) = procs.iter_mut().find_map(|p| p.exited().map(|s| (p.log_tail(), s))) {
            return Ok::<_, String>(Some(Err(format!("a container exited ({status}) first:\n{tail}"))));
        }
        let ok = opskit::http::blocking::status(addr, path, Duration::from_secs(5)).ok() == Some(200);
        Ok(ok.then_some(Ok(())))
    });
    waited.map_err(|e| e.to_string()).and_then(|r| r).map_err(|e| {
        let logs: String = procs.iter().map(|p| format!("\n{}", p.log_tail())).collect();
        format!("{e}{logs}")
    })
}

/// The containers of the rendered overlay that run the `tandem` image, with their pod.
fn tandem_containers(docs: &[Value]) -> Vec<(String, &Value, &Value)> {
    let out: Vec<_> = containers(docs)
        .into_iter()
        .filter(|(_, _, c)| {
            let image = c["image"].as_str().unwrap_or_default();
            let name = image.split('@').next().unwrap_or_default().rsplit('/').next().unwrap_or_default();
            name.split(':').next() == Some("tandem")
        })
        .collect();
    let names: Vec<&str> = out.iter().map(|(n, _, _)| n.as_str()).collect();
    assert!(out.len() >= 3, "the overlay runs coordinator, prefill and decode from the tandem image: found {names:?}");
    out
}

/// The container's args with the pod's fieldRef env filled in (and added to
/// `process_env`), every `HOST:PORT` value moved to `127.0.0.1:0` (the binaries print what
/// they bound: no port is picked here and released for another process to take) and
/// `--etcd` set to `etcd`.
fn local_args(workload: &str, c: &Value, etcd: &str, process_env: &mut Vec<String>) -> Vec<String> {
    let mut env = BTreeMap::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some("status.podIP") => "127.0.0.1".to_owned(),
            Some("metadata.name") => format!("{workload}-0"),
            // The node's zone on the pod's labels (PodTopologyLabelsAdmission): one zone here.
            Some("metadata.labels['topology.kubernetes.io/zone']") => "zone-a".to_owned(),
            Some(other) => panic!("{workload}: env from fieldRef {other}: the test cannot provide it"),
            None => {
                e["value"].as_str().unwrap_or_else(|| panic!("{workload}: env {} has no value", e["name"])).to_owned()
            }
        };
        let name = e["name"].as_str().expect("env name");
        process_env.push(format!("{name}={value}"));
        env.insert(format!("$({name})"), value);
    }
    let mut args: Vec<String> =
        c["command"].as_array().expect("a command").iter().map(|a| a.as_str().expect("text").to_owned()).collect();
    for a in c["args"].as_array().into_iter().flatten() {
        let mut a = a.as_str().expect("text").to_owned();
        for (k, v) in &env {
            a = a.replace(k, v);
        }
        let moved = match a.split_once('=') {
            Some(("--etcd", _)) => format!("--etcd={etcd}"),
            Some((flag, value)) if value.parse::<std::net::SocketAddr>().is_ok() => format!("{flag}=127.0.0.1:0"),
            _ => a,
        };
        args.push(moved);
    }
    args
}

/// The container's volume mounts as OCI mounts: the model claim binds the test model at
/// `/models/model.gguf`, a Secret binds a directory of the overlay's files of that name,
/// an emptyDir is a tmpfs.
fn local_mounts(workload: &str, pod: &Value, c: &Value, model: &Path, secrets: &Path) -> Vec<Value> {
    let volumes = pod["spec"]["volumes"].as_array().cloned().unwrap_or_default();
    let mut out = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let (name, path) = (m["name"].as_str().expect("mount name"), m["mountPath"].as_str().expect("mountPath"));
        let v = volumes.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("{workload}: no volume {name}"));
        if v.get("persistentVolumeClaim").is_some() {
            out.push(bind(model, &format!("{path}/model.gguf")));
        } else if let Some(secret) = v["secret"]["secretName"].as_str() {
            out.push(bind(&secrets.join(secret), path));
        } else if v.get("emptyDir").is_some() {
            out.push(tmpfs(path));
        } else {
            panic!("{workload}: volume {name} is of a kind this test cannot provide: {v}");
        }
    }
    out
}

/// The Secrets the overlay generates, as directories of files (what the kubelet mounts).
fn secret_dirs(dir: &Path) -> PathBuf {
    let overlay = root().join(manifests::OVERLAY);
    let kustomization: Value = yaml_docs(&read(&overlay.join("kustomization.yaml"))).remove(0);
    let secrets = dir.join("secrets");
    for s in kustomization["secretGenerator"].as_array().into_iter().flatten() {
        let d = secrets.join(s["name"].as_str().expect("secret name"));
        std::fs::create_dir_all(&d).expect("secret dir");
        for f in s["files"].as_array().into_iter().flatten() {
            let f = f.as_str().expect("file name");
            std::fs::copy(overlay.join(f), d.join(f)).expect("copy a secret's file");
        }
    }
    secrets
}

/// The first API key of the overlay's tenants file (`keys = ["..."]`).
fn api_key() -> String {
    let tenants = read(&root().join(manifests::OVERLAY).join("tenants.toml"));
    let line = tenants.lines().find(|l| l.trim_start().starts_with("keys")).expect("a keys line in tenants.toml");
    line.split('"').nth(1).expect("a quoted key").to_owned()
}

#[test]
fn the_pack_runs_from_the_image_as_shipped_and_serves_a_chat_completion() {
    let images = image_dir();
    let model = engine::paths::default_model_path();
    assert!(model.is_file(), "test model {} not found: run `make model`", model.display());
    reap_killed_runs();
    let dir = std::env::temp_dir().join(format!("{RUN_PREFIX}{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut runc = Runc { runc: tool("runc"), state: dir.join("runc"), dir: dir.clone(), started: Vec::new() };

    image_is_of_this_tree(&images.join("tandem"));
    let tandem_bundle = dir.join("tandem");
    let tandem_image = unpack(&images.join("tandem"), &tandem_bundle);
    let etcd_bundle = dir.join("etcd");
    let etcd_image = unpack(&images.join("etcd"), &etcd_bundle);
    for (name, config) in [("tandem", &tandem_image), ("etcd", &etcd_image)] {
        let uid = config["process"]["user"]["uid"].as_u64().expect("a user in the image config");
        assert_ne!(uid, 0, "the {name} image runs as root by default");
    }

    let docs = yaml_docs(&rendered());
    // etcd: the etcd image, one member on loopback, with the pack's other flags.
    // etcd takes no port 0 (its peer URL is its member identity): two distinct free ones.
    let ports = opskit::process::free_ports(2).expect("two free loopback ports");
    let (client, peer) = (format!("127.0.0.1:{}", ports[0]), format!("127.0.0.1:{}", ports[1]));
    let pack_etcd = containers(&docs)
        .into_iter()
        .find(|(_, _, c)| c["command"][0] == "etcd")
        .map(|(_, _, c)| c.clone())
        .expect("an etcd container in the pack");
    let mut etcd_args: Vec<String> = vec![
        "etcd".into(),
        "--name=etcd".into(),
        format!("--listen-client-urls=http://{client}"),
        format!("--advertise-client-urls=http://{client}"),
        format!("--listen-peer-urls=http://{peer}"),
        format!("--initial-advertise-peer-urls=http://{peer}"),
        format!("--initial-cluster=etcd=http://{peer}"),
    ];
    let own = ["--name", "--listen-", "--advertise-", "--initial-"];
    etcd_args.extend(
        pack_etcd["args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str())
            .filter(|a| !own.iter().any(|o| a.starts_with(o)))
            .map(str::to_owned),
    );
    // The pack's --data-dir (its volume claim): a tmpfs the user owns, not size-capped
    // (etcd grows its database file toward the pack's --quota-backend-bytes).
    let data_dir =
        etcd_args.iter().find_map(|a| a.strip_prefix("--data-dir=")).expect("the pack's etcd --data-dir").to_owned();
    let data = json!({"destination": data_dir, "type": "tmpfs", "source": "tmpfs",
        "options": ["nosuid", "nodev", "mode=0700", "uid=10001", "gid=10001"]});
    let etcd_spec = Spec {
        name: "etcd".into(),
        args: etcd_args,
        uid: 10001,
        gid: 10001,
        readonly: true,
        mounts: vec![tmpfs("/tmp"), data],
        env: Vec::new(),
    };
    let mut etcd = runc.run(&etcd_bundle, &etcd_image, &etcd_spec, &[]);
    answers_200(&client, "/health", std::slice::from_mut(&mut etcd)).unwrap_or_else(|e| panic!("etcd: {e}"));

    // The pack's tandem containers: workers first, the coordinator last.
    let secrets = secret_dirs(&dir);
    let mut tandem = tandem_containers(&docs);
    tandem.sort_by_key(|(_, _, c)| c["command"][0] == "tandem-coordinator");
    let mut running = Vec::new();
    let mut specs = Vec::new();
    let (mut http, mut coordinator_metrics) = (None, None);
    for (workload, pod, c) in &tandem {
        let mut env = Vec::new();
        let args = local_args(workload, c, &format!("http://{client}"), &mut env);
        let security = &pod["spec"]["securityContext"];
        let id = |k: &str| c["securityContext"][k].as_u64().or_else(|| security[k].as_u64());
        let spec = Spec {
            name: workload.clone(),
            args,
            uid: id("runAsUser").expect("runAsUser in the pod's securityContext"),
            gid: id("runAsGroup").expect("runAsGroup in the pod's securityContext"),
            readonly: c["securityContext"]["readOnlyRootFilesystem"] == true,
            mounts: local_mounts(workload, pod, c, &model, &secrets),
            env,
        };
        let coordinator = c["command"][0] == "tandem-coordinator";
        let wants: &[&str] = if coordinator { &["http", "metrics"] } else { &["grpc", "metrics"] };
        let p = runc.run(&tandem_bundle, &tandem_image, &spec, wants);
        if coordinator {
            http = Some(p.addr("http").expect("listening http="));
            coordinator_metrics = Some(p.addr("metrics").expect("listening metrics="));
        }
        running.push((spec, p));
    }
    let http = http.expect("a coordinator in the pack");
    let coordinator_metrics = coordinator_metrics.expect("a coordinator in the pack");

    let mut procs: Vec<Proc> = running
        .drain(..)
        .map(|(s, p)| {
            specs.push(s);
            p
        })
        .collect();
    answers_200(&http, "/ready", &mut procs).unwrap_or_else(|e| panic!("the coordinator: {e}"));
    let running: Vec<(Spec, Proc)> = specs.into_iter().zip(procs).collect();

    // Well over the coordinator's local-prefill threshold (32 tokens): prefilled by the
    // prefill container and moved to the decode container over the pack's KV transport.
    let question = "Paris, Lyon, Marseille, Toulouse, Nice, Nantes, Strasbourg, Montpellier, Bordeaux and \
                    Lille are cities of France. Which of them is the capital of France? Answer in one word.";
    let body = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
    });
    let chat = |key: Option<&str>| {
        let mut r = opskit::http::Request::post(&http, "/v1/chat/completions").json(&body).timeout(WAIT);
        if let Some(k) = key {
            r = r.header("authorization", &format!("Bearer {k}"));
        }
        r.send_blocking().expect("the chat request got an answer")
    };
    let anonymous = chat(None);
    assert_eq!(anonymous.status, 401, "the pack serves without an API key: {}", anonymous.text());
    let answer = chat(Some(&api_key()));
    assert_eq!(answer.status, 200, "chat completion: {}", answer.text());
    let content =
        answer.json().expect("JSON")["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned();
    assert!(!content.trim().is_empty(), "an empty answer: {}", answer.text());
    let page = opskit::prom::scrape_blocking(&coordinator_metrics).expect("the coordinator's /metrics");
    let prefilled = page.sum(PREFILL_ATTEMPTS, &[("outcome", "ok")]).unwrap_or(0.0);
    let all = page.sum(PREFILL_ATTEMPTS, &[]).unwrap_or(0.0);
    assert!(prefilled >= 1.0 && prefilled == all, "remote prefills: {prefilled} ok of {all}: the KV did not move");

    // Each binary: PID 1 of its container, the pod's user, a read-only root, no capability.
    for (spec, _) in &running {
        let pid = runc.pid(&spec.name);
        assert_eq!(status_field(pid, "NSpid").split_whitespace().last(), Some("1"), "{} is not PID 1", spec.name);
        let uids: Vec<String> = status_field(pid, "Uid").split_whitespace().map(str::to_owned).collect();
        assert!(uids.iter().all(|u| *u == spec.uid.to_string()), "{} runs as uids {uids:?}", spec.name);
        assert_eq!(status_field(pid, "CapEff"), "0000000000000000", "{} has capabilities", spec.name);
        assert_eq!(status_field(pid, "NoNewPrivs"), "1", "{} may gain privileges", spec.name);
        let options = root_mount_options(pid);
        assert!(options.split(',').any(|o| o == "ro"), "{}: / is mounted {options}", spec.name);
    }

    // SIGTERM to PID 1 (what the kubelet sends): each drains and exits 0, the coordinator first.
    for (spec, mut p) in running.into_iter().rev() {
        let out = runc.cmd().args(["kill", &spec.name, "TERM"]).output().expect("runc kill");
        assert!(out.status.success(), "runc kill {}: {}", spec.name, String::from_utf8_lossy(&out.stderr));
        let status = opskit::wait::blocking::poll(&format!("{} exits on SIGTERM", spec.name), WAIT, || {
            Ok::<_, String>(p.exited())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", p.log_tail()));
        assert!(status.success(), "{} exited {status} on SIGTERM:\n{}", spec.name, p.log_tail());
    }
    drop(runc);
    let _ = std::fs::remove_dir_all(&dir);
}
