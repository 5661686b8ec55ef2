//! Tidy: the core's `planted-bugs` feature is turned on by fencelock-sim alone, so no
//! product crate (server, CLI, client) is ever built with it on purpose. (A
//! whole-workspace build unifies features and compiles the switch in, still off: it
//! does nothing unless `Core::plant_bugs` is called.)

use std::fs;
use std::path::PathBuf;

/// Crates whose manifest names the feature: the core, which defines it; the server,
/// which defines its own `planted-bugs` (off unless asked; it forwards to the core's
/// and switches on the cluster simulation's hooks); and the one allowed to enable it.
const ALLOWED: [&str; 4] = [
    "fencelock-cluster-sim",
    "fencelock-core",
    "fencelock-server",
    "fencelock-sim",
];

/// The crates (by folder name) whose manifest text mentions `planted-bugs` outside
/// comments.
fn crates_naming_the_feature(manifests: &[(String, String)]) -> Vec<String> {
    manifests
        .iter()
        .filter(|(_, text)| {
            text.lines()
                .map(|l| l.split('#').next().unwrap_or(""))
                .any(|l| l.contains("planted-bugs"))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

#[test]
fn only_the_simulation_enables_planted_bugs() {
    let crates = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut manifests = Vec::new();
    for entry in fs::read_dir(&crates).expect("read crates/") {
        let dir = entry.expect("dir entry").path();
        let manifest = dir.join("Cargo.toml");
        if let Ok(text) = fs::read_to_string(&manifest) {
            let name = dir
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            manifests.push((name, text));
        }
    }
    assert!(
        manifests.len() >= 3,
        "found too few crates in {}",
        crates.display()
    );
    let mut naming = crates_naming_the_feature(&manifests);
    naming.sort();
    assert_eq!(
        naming, ALLOWED,
        "only {ALLOWED:?} may name the planted-bugs feature"
    );
    let root = fs::read_to_string(crates.join("../Cargo.toml")).expect("root Cargo.toml");
    assert!(
        crates_naming_the_feature(&[("root".into(), root)]).is_empty(),
        "the workspace manifest must not enable planted-bugs"
    );
}

#[test]
fn the_scan_catches_a_planted_enable() {
    let clean = (
        "fencelock-server".to_owned(),
        "[dependencies]\nfencelock-core.workspace = true\n# not planted-bugs\n".to_owned(),
    );
    let planted = (
        "fencelock-cli".to_owned(),
        "[dependencies]\nfencelock-core = { workspace = true, features = [\"planted-bugs\"] }\n"
            .to_owned(),
    );
    assert!(crates_naming_the_feature(std::slice::from_ref(&clean)).is_empty());
    assert_eq!(
        crates_naming_the_feature(&[clean, planted]),
        ["fencelock-cli"]
    );
}
