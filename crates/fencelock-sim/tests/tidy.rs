//! Tidy: the core's `planted-bugs` feature is turned on by fencelock-sim alone, so no
//! product crate (server, CLI, client) is ever built with it on purpose. (A
//! whole-workspace build unifies features and compiles the switch in, still off: it
//! does nothing unless `Core::plant_bugs` is called.)

use std::fs;
use std::path::{Path, PathBuf};

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

// ---------------------------------------------------------------------------------------
// The documentation stays inside the repository and stays true to its layout.

/// The repository's root (this crate is `crates/fencelock-sim`).
fn repo_root() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

/// `path` as the repository names it (relative to its root), for messages.
fn shown(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Folders never scanned: build output, installed packages, fuzzing output and data
/// directories of local runs are not the project's text.
const SKIPPED_DIRS: [&str; 5] = [
    "target",
    "node_modules",
    "corpus",
    "artifacts",
    "fencelock-data",
];

/// Every file under `dir` (not in a hidden or skipped folder), at most `MAX_DEPTH`
/// folders deep.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    const MAX_DEPTH: usize = 12;
    let mut files = Vec::new();
    let mut pending = vec![(dir.to_path_buf(), 0)];
    while let Some((dir, depth)) = pending.pop() {
        let entries = fs::read_dir(&dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("dir entry").path();
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            if path.is_dir() {
                let skipped = name.starts_with('.') || SKIPPED_DIRS.contains(&name.as_str());
                assert!(depth < MAX_DEPTH, "{} is nested too deep", path.display());
                if !skipped {
                    pending.push((path, depth + 1));
                }
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The markdown files of the repository.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    files_under(root)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect()
}

/// The lines of `text` that are prose: fenced code blocks left out (as empty lines, so
/// line numbers stay right) and inline code spans blanked.
fn prose_lines(text: &str) -> Vec<String> {
    let mut in_fence = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
            lines.push(String::new());
            continue;
        }
        if in_fence {
            lines.push(String::new());
            continue;
        }
        // Blank every code span: the text between a backtick and the next one.
        let mut prose = String::with_capacity(line.len());
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                prose.push(' ');
            } else {
                prose.push(if in_code { ' ' } else { c });
            }
        }
        lines.push(prose);
    }
    lines
}

/// The targets of the inline links and images in `text` (`[text](target)`,
/// `![alt](target)`), with their line numbers, leaving out web and mail links.
fn relative_links(text: &str) -> Vec<(usize, String)> {
    let mut links = Vec::new();
    for (index, line) in prose_lines(text).iter().enumerate() {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            // A title may follow the target: `[x](path "title")`.
            let target = after[..end]
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_owned();
            rest = &after[end..];
            let external = ["http://", "https://", "mailto:"]
                .iter()
                .any(|scheme| target.starts_with(scheme));
            if !target.is_empty() && !external {
                links.push((index + 1, target));
            }
        }
    }
    links
}

/// The anchor a heading gets on GitHub: lower case, spaces to hyphens, punctuation
/// other than hyphens and underscores dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

/// The anchors of every heading in the markdown `text` (outside code blocks); a repeated
/// anchor gets `-1`, `-2`, … as on GitHub.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    let mut in_fence = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        let level = line.chars().take_while(|&c| c == '#').count();
        if in_fence || level == 0 || level > 6 || !line[level..].starts_with(' ') {
            continue;
        }
        let base = anchor(&line[level..]);
        let repeats = seen
            .iter()
            .filter(|a| {
                **a == base
                    || a.strip_prefix(&format!("{base}-"))
                        .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
            })
            .count();
        seen.push(if repeats == 0 {
            base
        } else {
            format!("{base}-{repeats}")
        });
    }
    seen
}

/// What is wrong with the relative links of the markdown file `file` (whose text is
/// `text`) under the repository `root`: targets that do not exist, and `#anchors` that
/// no heading of the target markdown file has.
fn broken_links(root: &Path, file: &Path, text: &str) -> Vec<String> {
    let mut broken = Vec::new();
    for (line, target) in relative_links(text) {
        let (path, fragment) = match target.split_once('#') {
            Some((path, fragment)) => (path, Some(fragment)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else if let Some(from_root) = path.strip_prefix('/') {
            root.join(from_root)
        } else {
            file.parent().expect("a file has a folder").join(path)
        };
        let at = format!("{}:{line}: ({target})", shown(root, file));
        if !resolved.exists() {
            broken.push(format!("{at} names a file that does not exist"));
            continue;
        }
        let Some(fragment) = fragment else { continue };
        if resolved.extension().is_some_and(|e| e == "md") {
            let target_text = fs::read_to_string(&resolved).unwrap_or_default();
            if !anchors(&target_text).iter().any(|a| a == fragment) {
                broken.push(format!("{at} names a heading that does not exist"));
            }
        }
    }
    broken
}

#[test]
fn every_relative_markdown_link_resolves() {
    let root = repo_root();
    let files = markdown_files(&root);
    assert!(
        files.iter().any(|f| f.ends_with("README.md")) && files.len() >= 4,
        "found too few markdown files under {}: {files:?}",
        root.display()
    );
    let mut broken = Vec::new();
    for file in &files {
        let text =
            fs::read_to_string(file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
        broken.extend(broken_links(&root, file, &text));
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_check_catches_planted_broken_links() {
    let root = repo_root();
    let readme = root.join("README.md");
    let clean = "[design](docs/design.md), [its §2](docs/design.md#2-semantics), \
                 [here](#run-it), [web](https://example.invalid/x), `[code](nope.md)`\n\
                 ```\n[in a block](nope.md)\n```\n";
    assert_eq!(broken_links(&root, &readme, clean), Vec::<String>::new());
    let planted =
        "See [the design](docs/nope.md) and [a section](docs/design.md#no-such-heading).\n\
                   ![chart](bench-results/missing.svg) [anchor](#nowhere)\n";
    let found = broken_links(&root, &readme, planted);
    assert_eq!(found.len(), 4, "{found:#?}");
    assert!(
        found[0].contains("README.md:1: (docs/nope.md)"),
        "{found:#?}"
    );
    assert!(found[3].contains("README.md:2: (#nowhere)"), "{found:#?}");
}

#[test]
fn headings_get_githubs_anchors() {
    let text = "# fencelock\n## 1. What fencelock is, and what a lock cannot do\n\
                ### `crates/fencelock-core`\n## Notes\n## Notes\n```sh\n# a comment\n```\n";
    assert_eq!(
        anchors(text),
        [
            "fencelock",
            "1-what-fencelock-is-and-what-a-lock-cannot-do",
            "cratesfencelock-core",
            "notes",
            "notes-1"
        ]
    );
}

/// Text that points outside the repository: the workspace this project was started
/// from, and its design and style notes. Spelled in parts so this file does not match.
const OUTSIDE: [&str; 4] = [
    concat!("../", "shared"),
    concat!("/work/", "shared"),
    concat!("DESIGN", ".md"),
    concat!("STYLE", ".md"),
];

/// Where in the text of `file` it points outside the repository.
fn outside_pointers(file: &Path, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (index, line) in text.lines().enumerate() {
        for pattern in OUTSIDE {
            if line.contains(pattern) {
                found.push(format!("{}:{}: {pattern}", file.display(), index + 1));
            }
        }
    }
    found
}

#[test]
fn nothing_points_outside_the_repository() {
    let root = repo_root();
    let mut found = Vec::new();
    let mut scanned = 0;
    for file in files_under(&root) {
        // Binary and very large files are not the project's prose or code.
        let small = fs::metadata(&file).is_ok_and(|m| m.len() <= 1 << 20);
        let Some(text) = small.then(|| fs::read_to_string(&file).ok()).flatten() else {
            continue;
        };
        scanned += 1;
        found.extend(outside_pointers(Path::new(&shown(&root, &file)), &text));
    }
    assert!(
        scanned >= 100,
        "scanned only {scanned} files under {}",
        root.display()
    );
    assert!(
        found.is_empty(),
        "pointers outside the repository:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_outside_check_catches_a_planted_pointer() {
    let file = Path::new("docs/x.md");
    assert!(outside_pointers(file, "See docs/design.md and ARCHITECTURE.md.\n").is_empty());
    let planted = format!("intro\nas in [the spec]({}/{})\n", OUTSIDE[0], OUTSIDE[2]);
    assert_eq!(
        outside_pointers(file, &planted),
        [
            format!("docs/x.md:2: {}", OUTSIDE[0]),
            format!("docs/x.md:2: {}", OUTSIDE[2])
        ]
    );
}

/// ARCHITECTURE.md is a map to hold in one's head, not a second copy of the code.
const ARCHITECTURE_MAX_LINES: usize = 250;

#[test]
fn architecture_md_stays_short() {
    let text = fs::read_to_string(repo_root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let lines = text.lines().count();
    assert!(
        (20..=ARCHITECTURE_MAX_LINES).contains(&lines),
        "ARCHITECTURE.md has {lines} lines; keep it at most {ARCHITECTURE_MAX_LINES}"
    );
}

/// The fencelock crates a manifest depends on (normal and build dependencies, not
/// dev-dependencies, which tests may use freely).
fn fencelock_dependencies(manifest: &str) -> Vec<String> {
    let mut deps = Vec::new();
    let mut in_deps = false;
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_end_matches(']');
            // `[dependencies]`, `[target.'cfg(…)'.dependencies]`, `[dependencies.name]`.
            in_deps = false;
            if let Some((before, after)) = header.rsplit_once("dependencies") {
                let dev = before.ends_with("dev-");
                if !dev && after.is_empty() {
                    in_deps = true;
                } else if let Some(name) = after.strip_prefix('.').filter(|_| !dev) {
                    if name.starts_with("fencelock") {
                        deps.push(name.to_owned());
                    }
                }
            }
            continue;
        }
        if in_deps {
            let name = line.split(['=', '.']).next().unwrap_or("").trim();
            if name.starts_with("fencelock") {
                deps.push(name.to_owned());
            }
        }
    }
    deps.sort();
    deps.dedup();
    deps
}

/// The store crates: each implements `LockBackend` for one store.
const STORE_CRATES: [&str; 5] = [
    "fencelock-etcd",
    "fencelock-mysql",
    "fencelock-postgres",
    "fencelock-redis",
    "fencelock-zookeeper",
];

/// The dependency edges that break the layering in `manifests` (crate folder, manifest
/// text): the client library on the server or anything under it, a store crate on any
/// fencelock crate but `fencelock-backend`, the backend trait crate on any.
fn layering_violations(manifests: &[(String, String)]) -> Vec<String> {
    let mut violations = Vec::new();
    for (name, text) in manifests {
        let allowed: &[&str] = match name.as_str() {
            "fencelock-backend" => &[],
            store if STORE_CRATES.contains(&store) => &["fencelock-backend"],
            "fencelock" => &[
                "fencelock-backend",
                "fencelock-proto",
                "fencelock-etcd",
                "fencelock-mysql",
                "fencelock-postgres",
                "fencelock-redis",
                "fencelock-zookeeper",
            ],
            _ => continue,
        };
        for dep in fencelock_dependencies(text) {
            if !allowed.contains(&dep.as_str()) {
                violations.push(format!("{name} depends on {dep}"));
            }
        }
    }
    violations
}

#[test]
fn crate_dependencies_point_one_way() {
    let crates = repo_root().join("crates");
    let mut manifests = Vec::new();
    for entry in fs::read_dir(&crates).expect("read crates/") {
        let dir = entry.expect("dir entry").path();
        if let Ok(text) = fs::read_to_string(dir.join("Cargo.toml")) {
            let name = dir
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            manifests.push((name, text));
        }
    }
    let names: Vec<&str> = manifests.iter().map(|(n, _)| n.as_str()).collect();
    for needed in ["fencelock", "fencelock-backend", "fencelock-redis"] {
        assert!(
            names.contains(&needed),
            "no crate {needed} under {}",
            crates.display()
        );
    }
    let violations = layering_violations(&manifests);
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn the_dependency_check_catches_planted_edges() {
    let client = "[dependencies]\nfencelock-backend.workspace = true\n\
                  fencelock-redis = { workspace = true, optional = true }\n\
                  [dev-dependencies]\nfencelock-server.workspace = true\n";
    let store = "[dependencies]\nfencelock-backend = { path = \"../fencelock-backend\" }\n\
                 [build-dependencies]\nprotox = \"0.9\"\n";
    let clean = vec![
        ("fencelock".to_owned(), client.to_owned()),
        ("fencelock-etcd".to_owned(), store.to_owned()),
    ];
    assert_eq!(layering_violations(&clean), Vec::<String>::new());
    let planted = vec![
        (
            "fencelock".to_owned(),
            format!("{client}\n[dependencies.fencelock-server]\npath = \"x\"\n"),
        ),
        (
            "fencelock-mysql".to_owned(),
            format!("{store}[dependencies]\nfencelock = \"0.1\"\n"),
        ),
        (
            "fencelock-backend".to_owned(),
            "[target.'cfg(unix)'.dependencies]\nfencelock-core.workspace = true\n".to_owned(),
        ),
    ];
    assert_eq!(
        layering_violations(&planted),
        [
            "fencelock depends on fencelock-server",
            "fencelock-mysql depends on fencelock",
            "fencelock-backend depends on fencelock-core"
        ]
    );
}
