//! The starter on `sh` scripts that print what a tandem process prints.

use super::*;

fn sh(script: &str) -> Launch {
    Launch::path("/bin/sh").name("script").args(["-c", script])
}

#[tokio::test]
async fn addresses_are_read_from_listening_lines_and_drop_kills() {
    let dir = std::env::temp_dir().join(format!("opskit-process-test-{}", std::process::id()));
    let p = sh("echo starting; echo 'listening http=127.0.0.1:1 grpc=127.0.0.1:2'; echo said >&2; exec sleep 60")
        .wants(&["http", "grpc"])
        .log_dir(&dir)
        .start()
        .await
        .expect("start");
    assert_eq!(p.addr("http").expect("http"), "127.0.0.1:1");
    assert_eq!(p.socket_addr("grpc").expect("grpc").port(), 2);
    assert!(p.addr("metrics").is_err());
    assert_eq!(p.log_path(), dir.join("script.log"));
    let pid = p.pid;
    assert!(running(pid));
    // Its stderr reaches the log (polled: the write races the check).
    crate::eventually("the log holds its stderr", Duration::from_secs(10), || async { p.log_tail().contains("said") })
        .await
        .expect("log");
    drop(p);
    assert!(matches!(proc_state(pid), None | Some('Z')), "dropping it kills it");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_early_exit_and_a_silence_are_errors_that_say_so() {
    let e = sh("echo bad flag >&2; exit 3").wants(&["http"]).start_blocking().expect_err("exits");
    let text = e.to_string();
    assert!(text.contains("exited") && text.contains("`listening http=`") && text.contains("bad flag"), "{text}");
    let e = sh("exec sleep 60").wants(&["http"]).wait(Duration::from_millis(300)).start_blocking().expect_err("silent");
    assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("did not print `listening http=`"), "{e}");
    let e = sh("echo 'listening http=x'; echo ready; exec sleep 60")
        .wants(&["http"])
        .until_line("table")
        .wait(Duration::from_millis(300))
        .start_blocking()
        .expect_err("no table");
    assert!(e.to_string().contains("a line starting `table`"), "{e}");
    let p = sh("echo 'table: 3 rows'; exec sleep 60").until_line("table").start_blocking().expect("table");
    assert!(running(p.pid));
}

#[test]
fn a_missing_binary_says_how_to_build_it() {
    let e = bin("tandem-no-such-binary").expect_err("not built");
    assert!(e.to_string().contains("cargo build --workspace --bins"), "{e}");
    let e = Launch::bin("tandem-no-such-binary").start_blocking().expect_err("not built");
    assert!(e.to_string().contains("is not built beside"), "{e}");
}

#[test]
fn stop_sends_sigterm_and_reports_the_exit() {
    let mut p = sh("trap 'exit 7' TERM; echo 'listening x=1'; while :; do sleep 0.05; done")
        .wants(&["x"])
        .start_blocking()
        .expect("start");
    let st = p.stop_blocking(Duration::from_secs(10)).expect("stops");
    assert_eq!(st.code(), Some(7));
    assert!(p.exited().is_some());
}

#[tokio::test]
async fn restart_keeps_the_old_log_and_starts_the_same_program() {
    let dir = std::env::temp_dir().join(format!("opskit-restart-test-{}", std::process::id()));
    let mut p = sh("echo \"listening pid=$$\"; echo life >&2; exec sleep 60")
        .wants(&["pid"])
        .log_dir(&dir)
        .start()
        .await
        .expect("start");
    let first = p.addr("pid").expect("pid");
    assert!(p.restart(None).await.is_err(), "restart refuses a running process");
    p.kill9().await.expect("killed");
    p.restart(None).await.expect("restart");
    assert_ne!(p.addr("pid").expect("pid"), first);
    assert_eq!(p.log_paths().count(), 2, "the old log is kept: {:?}", p.log_paths().collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_adopted_process_is_left_running_and_its_exit_seen_through_proc() {
    let mut child = Command::new("sleep").arg("60").spawn().expect("spawn sleep");
    let pid = child.id();
    let addrs = HashMap::from([("http".to_owned(), "127.0.0.1:1".to_owned())]);
    let mut p = Proc::adopt("adopted", pid, addrs, None);
    assert!(p.is_adopted());
    assert_eq!(p.addr("http").expect("addr"), "127.0.0.1:1");
    assert_eq!(p.log_paths().count(), 0, "no log to scan");
    assert!(p.exited().is_none());
    drop(p);
    assert!(matches!(proc_state(pid), Some(s) if s != 'Z'), "dropping an adopted process must not kill it");
    let mut p = Proc::adopt("adopted", pid, HashMap::new(), None);
    assert!(p.restart(None).await.is_err(), "not ours to restart");
    p.signal(Signal::Kill).expect("kill");
    // Our child here, so reap it; an adopted one's exit shows as the pid gone (or a zombie).
    let _ = child.wait();
    assert!(p.wait_exit(Duration::from_secs(10)).await.is_ok());
}

#[test]
fn status_fields_are_read_in_kib_and_a_missing_one_is_none() {
    let me = std::process::id();
    let rss = status_kib(me, "VmRSS").expect("this process has a resident set");
    let anon = status_kib(me, "RssAnon").expect("and anonymous memory");
    assert!(anon > 0 && anon <= rss, "RssAnon {anon} KiB within VmRSS {rss} KiB");
    // A field name is matched whole: `VmRS` is no field, `Threads` has no kB.
    assert_eq!(status_kib(me, "VmRS"), None);
    assert_eq!(status_kib(me, "Threads"), None);
    assert_eq!(status_kib(u32::MAX, "VmRSS"), None, "no such pid");
}
