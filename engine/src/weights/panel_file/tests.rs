//! The host panel file's rules on synthetic panels: built once, mapped by
//! the next, refused when stale, foreign or corrupt, pruned when unused,
//! and a directory others may write is not used.

use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("tandem-panels-{}-{tag}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn store(dir: &Path, model: u8) -> PanelStore {
    PanelStore { dir: dir.to_owned(), model_digest: [model; 32], private_on_error: false }
}

fn plan(sizes: &[usize]) -> Plan {
    let mut p = Plan::default();
    for (i, &n) in sizes.iter().enumerate() {
        p.push(&format!("blk.{i}.w"), n);
    }
    p
}

/// Fills a slot with bytes that depend on its name and position, counting calls.
fn packer(calls: &AtomicUsize) -> impl FnMut(&Slot, &mut [u8]) -> Result<(), PanelError> + '_ {
    move |slot, out| {
        calls.fetch_add(1, Ordering::Relaxed);
        for (i, b) in out.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(slot.name.len() as u8).wrapping_add(slot.offset as u8);
        }
        Ok(())
    }
}

/// What a private buffer laid out by the same plan holds.
fn expected(plan: &Plan) -> Vec<u8> {
    let calls = AtomicUsize::new(0);
    super::super::panels::pack_private(plan, packer(&calls)).expect("pack")
}

fn get(s: &PanelStore, p: &Plan, calls: &AtomicUsize) -> Result<Obtained, PanelError> {
    obtain(s, p, packer(calls), Duration::from_millis(200))
}

#[test]
fn the_first_process_packs_the_copy_and_the_next_maps_it() {
    let dir = TempDir::new("share");
    let (s, p) = (store(&dir.0, 1), plan(&[1000, 4096, 33]));
    let calls = AtomicUsize::new(0);
    let first = get(&s, &p, &calls).expect("first");
    assert!(first.built);
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    assert_eq!(first.shared.data(), expected(&p).as_slice());
    let second = get(&s, &p, &calls).expect("second");
    assert!(!second.built, "a valid copy is mapped, not packed again");
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    assert_eq!(second.path, first.path);
    assert_eq!(second.shared.data(), first.shared.data());
    assert_eq!(second.refused, None);
    let md = fs::metadata(&dir.0).expect("dir");
    assert_eq!(md.mode() & 0o777, 0o700);
    assert_eq!(fs::metadata(&first.path).expect("copy").mode() & 0o777, 0o600);
    // No temporary file is left behind.
    assert!(names(&dir.0).iter().all(|n| !n.contains(".tmp-")), "{:?}", names(&dir.0));
}

#[test]
fn a_corrupt_truncated_or_foreign_copy_is_refused_and_replaced() {
    let dir = TempDir::new("refuse");
    let (s, p) = (store(&dir.0, 1), plan(&[5000, 700]));
    let calls = AtomicUsize::new(0);
    let path = get(&s, &p, &calls).expect("first").path;
    let good = fs::read(&path).expect("read");

    // One flipped data byte: caught by the SHA-256.
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    fs::write(&path, &bad).expect("corrupt");
    let got = get(&s, &p, &calls).expect("rebuilt");
    assert!(got.built);
    assert!(got.refused.as_deref().is_some_and(|r| r.contains("SHA-256")), "{:?}", got.refused);
    assert_eq!(got.shared.data(), expected(&p).as_slice());
    drop(got);

    // Torn: shorter than its header says.
    fs::write(&path, &good[..good.len() - 10]).expect("truncate");
    let got = get(&s, &p, &calls).expect("rebuilt");
    assert!(got.refused.as_deref().is_some_and(|r| r.contains("torn")), "{:?}", got.refused);
    drop(got);

    // Not a panel file at all.
    fs::write(&path, b"hello").expect("garbage");
    let got = get(&s, &p, &calls).expect("rebuilt");
    assert!(got.refused.as_deref().is_some_and(|r| r.contains("truncated")), "{:?}", got.refused);
    drop(got);

    // Another model's copy under this key's name.
    let other = store(&dir.0, 2);
    let foreign = get(&other, &p, &calls).expect("other model").path;
    fs::rename(&foreign, &path).expect("plant");
    let got = get(&s, &p, &calls).expect("rebuilt");
    assert!(got.refused.as_deref().is_some_and(|r| r.contains("another model")), "{:?}", got.refused);
    assert_eq!(got.shared.data(), expected(&p).as_slice());
}

#[test]
fn a_copy_from_another_plan_or_layout_is_never_read() {
    // Another plan gets another key, so another file…
    let dir = TempDir::new("plan");
    let s = store(&dir.0, 1);
    assert_ne!(key(&s, &plan(&[100, 200])), key(&s, &plan(&[100, 201])));
    assert_ne!(key(&s, &plan(&[100])), key(&store(&dir.0, 2), &plan(&[100])));
    // …and a header for another plan under this key's name is refused.
    let calls = AtomicUsize::new(0);
    let (p, q) = (plan(&[100, 200]), plan(&[100, 300]));
    let path = get(&s, &p, &calls).expect("p").path;
    let path_q = get(&s, &q, &calls).expect("q").path;
    fs::copy(&path_q, &path).expect("plant");
    let got = get(&s, &p, &calls).expect("rebuilt");
    assert!(got.refused.as_deref().is_some_and(|r| r.contains("another set")), "{:?}", got.refused);
    // A header with another layout version.
    let text = fs::read(&path).expect("read");
    let layout = format!("\"layout\":{}", kernels::matmul::panels::PANEL_LAYOUT);
    let at = text.windows(layout.len()).position(|w| w == layout.as_bytes()).expect("layout in the header");
    let mut stale = text.clone();
    stale[at + layout.len() - 1] = b'9';
    drop(got);
    fs::write(&path, &stale).expect("stale");
    let got = get(&s, &p, &calls).expect("rebuilt");
    assert!(got.refused.as_deref().is_some_and(|r| r.contains("layout")), "{:?}", got.refused);
}

#[test]
fn unused_copies_of_other_keys_are_pruned_and_held_ones_kept() {
    let dir = TempDir::new("prune");
    let calls = AtomicUsize::new(0);
    let p = plan(&[300]);
    let old = get(&store(&dir.0, 1), &p, &calls).expect("old");
    let old_path = old.path.clone();
    // Held by a live mapping: kept.
    let new = get(&store(&dir.0, 2), &p, &calls).expect("new");
    assert!(new.pruned.is_empty());
    assert!(old_path.exists());
    drop(old);
    // An unrelated file in the directory is never touched.
    fs::write(dir.0.join("notes.txt"), b"mine").expect("write");
    let again = get(&store(&dir.0, 2), &p, &calls).expect("again");
    assert_eq!(again.pruned, vec![old_path.clone()]);
    assert!(!old_path.exists());
    assert!(dir.0.join("notes.txt").exists());
    let left: Vec<_> = names(&dir.0).into_iter().filter(|n| n != "notes.txt").collect();
    assert_eq!(left.len(), 2, "only the kept key's lock and copy: {left:?}");
    assert_eq!(again.shared.data(), new.shared.data());
}

#[test]
fn concurrent_loads_pack_once() {
    let dir = TempDir::new("race");
    let (s, p) = (store(&dir.0, 1), plan(&[1 << 20, 1 << 16]));
    let calls = AtomicUsize::new(0);
    let built: Vec<bool> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|_| sc.spawn(|| obtain(&s, &p, packer(&calls), Duration::from_secs(30)).expect("obtain").built))
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert_eq!(built.iter().filter(|b| **b).count(), 1, "{built:?}");
    assert_eq!(calls.load(Ordering::Relaxed), 2);
}

#[test]
fn a_held_lock_times_out_with_its_name() {
    let dir = TempDir::new("lock");
    let (s, p) = (store(&dir.0, 1), plan(&[64]));
    prepare_dir(&dir.0).expect("dir");
    let held = lock_exclusive(&dir.0.join(format!("{}.lock", key(&s, &p))), Duration::ZERO).expect("lock");
    let calls = AtomicUsize::new(0);
    let err = get(&s, &p, &calls).err().expect("times out");
    assert!(matches!(err, PanelError::LockTimeout { .. }), "{err}");
    assert!(err.to_string().contains(".lock"), "{err}");
    assert_eq!(calls.load(Ordering::Relaxed), 0);
    drop(held);
    assert!(get(&s, &p, &calls).is_ok());
}

#[test]
fn a_directory_others_may_write_or_a_file_is_refused() {
    let dir = TempDir::new("unsafe");
    fs::create_dir_all(&dir.0).expect("dir");
    fs::set_permissions(&dir.0, fs::Permissions::from_mode(0o777)).expect("chmod");
    let calls = AtomicUsize::new(0);
    let p = plan(&[64]);
    let err = get(&store(&dir.0, 1), &p, &calls).err().expect("refused");
    assert!(err.to_string().contains("others may write"), "{err}");
    let file = dir.0.join("file");
    fs::write(&file, b"x").expect("file");
    let err = get(&store(&file, 1), &p, &calls).err().expect("refused");
    assert!(matches!(err, PanelError::Dir { .. }), "{err}");
    assert_eq!(calls.load(Ordering::Relaxed), 0);
}

#[test]
fn a_failed_pack_leaves_no_copy() {
    let dir = TempDir::new("fail");
    let (s, p) = (store(&dir.0, 1), plan(&[64, 64]));
    let fail = |slot: &Slot, _: &mut [u8]| Err(PanelError::Pack { name: slot.name.clone(), why: "planted".into() });
    let err = obtain(&s, &p, fail, Duration::ZERO).err().expect("fails");
    assert!(err.to_string().contains("planted"), "{err}");
    let left: Vec<_> = names(&dir.0).into_iter().filter(|n| !n.ends_with(".lock")).collect();
    assert!(left.is_empty(), "{left:?}");
}
