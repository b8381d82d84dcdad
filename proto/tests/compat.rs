//! The wire API stays compatible with the last release: the descriptors of every
//! released .proto file (`proto/released/*.binpb`, written by
//! `scripts/proto-release.sh` when a release is cut) against the ones built now
//! (`proto::FILE_DESCRIPTOR_SET`). A client or worker of the last release must
//! keep talking to this build, so nothing it knows may go or change meaning:
//!
//! - no package, service, method, message, enum or enum value removed;
//! - a method keeps its request and response types and their streaming;
//! - a field number keeps its name, type (and message/enum type name), label
//!   (`optional`, `repeated`) and oneof; a removed field's number and name must be
//!   `reserved` so they are never reused;
//! - an enum value number keeps its name.
//!
//! Adding is free. The rules are buf's `WIRE_JSON` category, which also keeps
//! names (our HTTP bridge and JSON tooling read them).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::collections::BTreeMap;
use std::path::PathBuf;

use prost::Message;
use prost_types::field_descriptor_proto::Label;
use prost_types::{DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorProto, FileDescriptorSet};

/// Every message and enum of a set by full name (`.tandem.worker.v1.Foo`), and
/// every service method by `service/method`.
#[derive(Default)]
struct Index {
    messages: BTreeMap<String, DescriptorProto>,
    enums: BTreeMap<String, EnumDescriptorProto>,
    methods: BTreeMap<String, (String, String, bool, bool)>,
    packages: Vec<String>,
}

fn index(set: &FileDescriptorSet) -> Index {
    let mut ix = Index::default();
    for file in &set.file {
        let package = file.package().to_owned();
        if package.starts_with("google.") {
            continue;
        }
        ix.packages.push(package.clone());
        let scope = format!(".{package}");
        for m in &file.message_type {
            add_message(&mut ix, &scope, m);
        }
        for e in &file.enum_type {
            ix.enums.insert(format!("{scope}.{}", e.name()), e.clone());
        }
        add_services(&mut ix, &package, file);
    }
    ix
}

fn add_message(ix: &mut Index, scope: &str, m: &DescriptorProto) {
    let name = format!("{scope}.{}", m.name());
    for nested in &m.nested_type {
        add_message(ix, &name, nested);
    }
    for e in &m.enum_type {
        ix.enums.insert(format!("{name}.{}", e.name()), e.clone());
    }
    ix.messages.insert(name, m.clone());
}

fn add_services(ix: &mut Index, package: &str, file: &FileDescriptorProto) {
    for s in &file.service {
        for m in &s.method {
            ix.methods.insert(
                format!("{package}.{}/{}", s.name(), m.name()),
                (m.input_type().to_owned(), m.output_type().to_owned(), m.client_streaming(), m.server_streaming()),
            );
        }
    }
}

/// What a field number means on the wire and in JSON.
fn meaning(m: &DescriptorProto, f: &FieldDescriptorProto) -> String {
    let label = match f.label() {
        Label::Repeated => "repeated",
        // proto3 `optional` is a synthetic oneof; a real oneof is named.
        _ if f.proto3_optional() => "optional",
        _ => "singular",
    };
    let oneof = match f.oneof_index {
        Some(i) if !f.proto3_optional() => {
            format!(" in oneof {}", m.oneof_decl.get(i as usize).map(|o| o.name()).unwrap_or("?"))
        }
        _ => String::new(),
    };
    format!("{} {label} {:?} {}{oneof}", f.name(), f.r#type(), f.type_name())
}

fn reserved(m: &DescriptorProto, number: i32, name: &str) -> bool {
    let number_reserved = m.reserved_range.iter().any(|r| (r.start()..r.end()).contains(&number));
    number_reserved && m.reserved_name.iter().any(|n| n == name)
}

/// Every way `now` breaks a client of `released`.
fn breaks(released: &FileDescriptorSet, now: &FileDescriptorSet) -> Vec<String> {
    let (old, new) = (index(released), index(now));
    let mut out = Vec::new();
    for p in &old.packages {
        if !new.packages.contains(p) {
            out.push(format!("package {p} removed"));
        }
    }
    for (name, sig) in &old.methods {
        match new.methods.get(name) {
            None => out.push(format!("method {name} removed")),
            Some(s) if s != sig => out.push(format!("method {name} changed: {sig:?} -> {s:?}")),
            Some(_) => {}
        }
    }
    for (name, m) in &old.messages {
        let Some(n) = new.messages.get(name) else {
            out.push(format!("message {name} removed"));
            continue;
        };
        for f in &m.field {
            match n.field.iter().find(|g| g.number() == f.number()) {
                None if reserved(n, f.number(), f.name()) => {}
                None => out.push(format!(
                    "{name} field {} ({}) removed without reserving its number and name",
                    f.number(),
                    f.name()
                )),
                Some(g) if meaning(m, f) != meaning(n, g) => {
                    out.push(format!("{name} field {} changed: {} -> {}", f.number(), meaning(m, f), meaning(n, g)))
                }
                Some(_) => {}
            }
        }
    }
    for (name, e) in &old.enums {
        let Some(n) = new.enums.get(name) else {
            out.push(format!("enum {name} removed"));
            continue;
        };
        for v in &e.value {
            match n.value.iter().find(|w| w.number() == v.number()) {
                None => out.push(format!("{name} value {} ({}) removed", v.number(), v.name())),
                Some(w) if w.name() != v.name() => {
                    out.push(format!("{name} value {} renamed {} -> {}", v.number(), v.name(), w.name()))
                }
                Some(_) => {}
            }
        }
    }
    out
}

fn released() -> Vec<(PathBuf, FileDescriptorSet)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("released");
    let mut sets: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "binpb"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            let set = FileDescriptorSet::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, set)
        })
        .collect();
    sets.sort_by(|a, b| a.0.cmp(&b.0));
    sets
}

fn current() -> FileDescriptorSet {
    FileDescriptorSet::decode(proto::FILE_DESCRIPTOR_SET).unwrap()
}

/// The frontend's GenerateRequest in `set`.
fn request(set: &mut FileDescriptorSet) -> &mut DescriptorProto {
    let file = set.file.iter_mut().find(|f| f.package() == "tandem.frontend.v1").unwrap();
    file.message_type.iter_mut().find(|m| m.name() == "GenerateRequest").unwrap()
}

#[test]
fn the_wire_api_keeps_every_released_meaning() {
    let sets = released();
    assert!(!sets.is_empty(), "no released descriptor set under proto/released");
    for (path, set) in sets {
        let broken = breaks(&set, &current());
        assert!(broken.is_empty(), "breaking changes against {}:\n{}", path.display(), broken.join("\n"));
    }
}

/// The check is not vacuous: the breaking changes it exists for are caught.
#[test]
fn a_removed_renumbered_or_retyped_field_is_caught() {
    let (_, released) = released().pop().unwrap();
    let edit = |f: &dyn Fn(&mut FileDescriptorSet)| {
        let mut now = current();
        f(&mut now);
        breaks(&released, &now)
    };
    // Removed (unreserved).
    let removed = edit(&|s| {
        let m = request(s);
        m.field.retain(|f| f.name() != "temperature");
    });
    assert!(removed.iter().any(|b| b.contains("temperature") && b.contains("removed")), "{removed:?}");
    // Removed but reserved: fine.
    let reserved_ok = edit(&|s| {
        let m = request(s);
        let n = m.field.iter().find(|f| f.name() == "temperature").unwrap().number();
        m.field.retain(|f| f.name() != "temperature");
        m.reserved_range.push(prost_types::descriptor_proto::ReservedRange { start: Some(n), end: Some(n + 1) });
        m.reserved_name.push("temperature".into());
    });
    assert!(reserved_ok.is_empty(), "{reserved_ok:?}");
    // Retyped.
    let retyped = edit(&|s| {
        let m = request(s);
        let f = m.field.iter_mut().find(|f| f.name() == "max_tokens").unwrap();
        f.set_type(prost_types::field_descriptor_proto::Type::Int64);
    });
    assert!(retyped.iter().any(|b| b.contains("max_tokens") && b.contains("changed")), "{retyped:?}");
    // Renumbered.
    let renumbered = edit(&|s| {
        let m = request(s);
        let f = m.field.iter_mut().find(|f| f.name() == "top_p").unwrap();
        f.number = Some(900);
    });
    assert!(!renumbered.is_empty(), "{renumbered:?}");
    // A method made unary.
    let method = edit(&|s| {
        let file = s.file.iter_mut().find(|f| f.package() == "tandem.frontend.v1").unwrap();
        let m = file.service[0].method.iter_mut().find(|m| m.name() == "Generate").unwrap();
        m.server_streaming = Some(false);
    });
    assert!(method.iter().any(|b| b.contains("Generate")), "{method:?}");
    // Adding a field is free.
    let added = edit(&|s| {
        let m = request(s);
        let mut f = m.field[0].clone();
        f.name = Some("a_new_field".into());
        f.number = Some(901);
        m.field.push(f);
    });
    assert!(added.is_empty(), "{added:?}");
}
