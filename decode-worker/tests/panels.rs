//! One weight copy per host: a prefill and a decode worker started with one panel
//! directory map the same packed panels (the prefill worker packs them, the decode
//! worker checks and maps them), so the decode worker's private weight memory is a
//! small fraction of the model; a third worker with `--panel-dir off` shows what each
//! worker held before.
//!
//! Memory is read from `/proc/PID/smaps` per mapping (private and shared pages by
//! mapping count), not RSS, which counts shared pages in full in every process.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{decode_worker, prefill_worker, TestResult};
use opskit::process::{mapped_pages, Pages};

fn of(map: &HashMap<String, Pages>, path: &Path) -> Pages {
    map.get(&path.display().to_string()).copied().unwrap_or_default()
}

#[test]
fn two_workers_on_one_host_hold_one_weight_copy() -> TestResult {
    let dir = std::env::temp_dir().join(format!("tandem-host-panels-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().ok_or("temp dir is not UTF-8")?;
    let model = std::fs::canonicalize(engine::paths::default_model_path())?;
    let model_kb = std::fs::metadata(&model)?.len() / 1024;

    let prefill = prefill_worker("g", &["--panel-dir", d])?;
    let decode = decode_worker("g", &["--panel-dir", d, "--kv-load-failure-policy", "fail"])?;
    let alone = decode_worker("g", &["--panel-dir", "off", "--kv-load-failure-policy", "fail"])?;

    let copies: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "panels"))
        .collect();
    assert_eq!(copies.len(), 1, "one copy for the host: {copies:?}");
    let copy = &copies[0];
    let copy_kb = std::fs::metadata(copy)?.len() / 1024;
    assert!(copy_kb * 2 > model_kb, "the panels are most of the model: {copy_kb} kB of {model_kb} kB");

    let (p, s, a) = (mapped_pages(prefill.pid)?, mapped_pages(decode.pid)?, mapped_pages(alone.pid)?);
    let (p_copy, s_copy, s_model) = (of(&p, copy), of(&s, copy), of(&s, &model));
    let weights_private = s_copy.private_kb + s_model.private_kb;
    let anon_saved = of(&a, Path::new("")).private_kb.saturating_sub(of(&s, Path::new("")).private_kb);
    println!(
        "model {model_kb} kB, panels {copy_kb} kB; prefill maps the copy {p_copy:?}; decode maps it {s_copy:?} and \
         the model file {s_model:?}: private weight memory {weights_private} kB ({:.1}% of the model); a worker \
         with private panels holds {anon_saved} kB more anonymous memory",
        100.0 * weights_private as f64 / model_kb as f64
    );
    // Both processes map every page of the one copy, so none of it is private to either.
    assert!(s_copy.rss_kb * 10 >= copy_kb * 9 && p_copy.rss_kb * 10 >= copy_kb * 9, "{p_copy:?} {s_copy:?}");
    assert!(s_copy.shared_kb * 10 >= copy_kb * 9, "the decode worker shares the copy: {s_copy:?}");
    assert!(weights_private * 10 <= model_kb, "private weight memory {weights_private} kB of {model_kb} kB");
    // The private-panels worker's anonymous memory holds the panels the shared one maps.
    assert!(anon_saved * 10 >= copy_kb * 9, "{anon_saved} kB of {copy_kb} kB");

    drop((prefill, decode, alone));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
