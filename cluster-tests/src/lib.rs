//! Multi-process tests on real etcd and real workers (`tests/`): every drill of the
//! `drills` crate run as a test, and KV crossing network namespaces. No code of its own:
//! what the tests drive is the `drills` crate's, the product code `tandem drill` runs.

#![forbid(unsafe_code)]
