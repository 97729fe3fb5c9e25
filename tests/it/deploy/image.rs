//! `deploy/Dockerfile`: what the build copies, what the image runs, and as whom.

use std::collections::BTreeSet;

use super::kubernetes::image_env;
use super::{default_port, flag_for_env, path, read};

// === Dockerfile ==================================================================================

/// The instructions of deploy/Dockerfile: (INSTRUCTION, rest), continuations joined.
pub(super) fn dockerfile() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in read("deploy/Dockerfile").lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (pending.is_empty() && trimmed.is_empty()) {
            continue;
        }
        if let Some(part) = trimmed.strip_suffix('\\') {
            pending.push_str(part);
            pending.push(' ');
            continue;
        }
        pending.push_str(trimmed);
        let (op, rest) = pending.split_once(' ').unwrap_or((&pending, ""));
        out.push((op.to_ascii_uppercase(), rest.trim().to_owned()));
        pending.clear();
    }
    out
}

pub(super) fn dockerfile_final_stage() -> Vec<(String, String)> {
    let all = dockerfile();
    let last_from = all.iter().rposition(|(op, _)| op == "FROM").expect("FROM");
    all[last_from..].to_vec()
}

pub(super) fn dockerfile_entrypoint() -> Vec<String> {
    let stage = dockerfile_final_stage();
    let (_, rest) = stage
        .iter()
        .rfind(|(op, _)| op == "ENTRYPOINT")
        .expect("ENTRYPOINT in the final stage");
    serde_json::from_str(rest).expect("ENTRYPOINT in exec (JSON) form")
}

pub(super) fn check_dockerfile(file: &str) {
    let all = dockerfile();
    let froms: Vec<&String> = all
        .iter()
        .filter(|(op, _)| op == "FROM")
        .map(|(_, r)| r)
        .collect();
    assert!(
        froms.len() >= 2,
        "{file}: multi-stage (a builder and a runtime)"
    );
    assert!(
        froms[0].starts_with("rust:"),
        "{file}: builds in an official Rust image"
    );
    assert!(
        all.iter()
            .any(|(op, r)| op == "RUN" && r.contains("cargo build --release --locked")),
        "{file}: cargo build --release --locked"
    );
    // Every COPY from the context names a path of the crate (the context is the crate root).
    for (op, rest) in &all {
        if op != "COPY" || rest.contains("--from=") {
            continue;
        }
        let words: Vec<&str> = rest
            .split_whitespace()
            .filter(|w| !w.starts_with("--"))
            .collect();
        for source in &words[..words.len() - 1] {
            assert!(
                path(source).exists(),
                "{file}: COPY {source}: no such path in the crate"
            );
        }
    }
    // The build reads lua/ (embedded) and proto/ (build.rs); cargo loads the manifest only with
    // every bench it declares and every workspace member present.
    for needed in [
        "src",
        "proto",
        "lua",
        "Cargo.lock",
        "build.rs",
        "benches",
        "testkit",
    ] {
        let copied = |r: &String| {
            r.split_whitespace()
                .any(|w| w.trim_end_matches('/') == needed)
        };
        assert!(
            all.iter().any(|(op, r)| op == "COPY" && copied(r)),
            "{file}: the build needs {needed}"
        );
    }
    let stage = dockerfile_final_stage();
    let non_root = match stage.iter().rfind(|(op, _)| op == "USER") {
        Some((_, user)) => !["0", "root"].contains(&user.split(':').next().unwrap_or_default()),
        None => stage[0].1.ends_with(":nonroot"),
    };
    assert!(
        non_root,
        "{file}: the runtime stage runs as a non-root user"
    );
    let exposed: BTreeSet<&str> = stage
        .iter()
        .filter(|(op, _)| op == "EXPOSE")
        .flat_map(|(_, r)| r.split_whitespace())
        .collect();
    for port in [default_port("--http-addr"), default_port("--grpc-addr")] {
        assert!(
            exposed.contains(port.to_string().as_str()),
            "{file}: EXPOSE {port}"
        );
    }
    let entrypoint = dockerfile_entrypoint();
    assert!(
        entrypoint
            .first()
            .is_some_and(|e| e.ends_with("/rlsd") || e == "rlsd")
            && entrypoint.get(1).map(String::as_str) == Some("serve"),
        "{file}: ENTRYPOINT runs `rlsd serve`: {entrypoint:?}"
    );
    // Image defaults are real rlsd variables, and the config directory holds a config.
    let env = image_env();
    for key in env.keys().filter(|k| k.starts_with("RLSD_")) {
        assert!(
            flag_for_env(key).is_some(),
            "{file}: ENV {key} is unknown to rlsd"
        );
    }
    let config = env.get("RLSD_CONFIG").expect("ENV RLSD_CONFIG");
    let ships = |r: &String| {
        r.split_whitespace()
            .last()
            .is_some_and(|d| d.starts_with(config.as_str()))
    };
    assert!(
        stage.iter().any(|(op, r)| op == "COPY" && ships(r)),
        "{file}: the image ships a config under {config}"
    );
}
