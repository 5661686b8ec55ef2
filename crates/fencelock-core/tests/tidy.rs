//! Tidy: `fencelock-core` stays sans-IO (docs/design.md §3: dependencies
//! point one way). It has no dependencies at all, and its code names no runtime, no
//! serialization, no clock, no file system, network, threads or randomness.
//!
//! The source scan strips comments and string/char literals first, so docs may talk
//! about what the core does *not* use. The scanner itself is tested on planted
//! snippets below, so a silent scanner cannot pass for a clean crate.

use std::fs;
use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

// ---------------------------------------------------------------------------------
// Cargo.toml: no [dependencies] (dev-dependencies are fine).
// ---------------------------------------------------------------------------------

/// Is this table header (without brackets) one whose entries are dependencies the
/// library is built with? `[dependencies]`, `[build-dependencies]`, their
/// `target.'cfg(..)'.` forms, and the `[dependencies.NAME]` forms of all of them.
fn is_dependency_table(header: &str) -> bool {
    let header = header.trim();
    let plain = |h: &str| {
        ["dependencies", "build-dependencies"]
            .iter()
            .any(|t| h == *t || h.starts_with(&format!("{t}.")))
    };
    let targeted = |h: &str| {
        h.starts_with("target.")
            && [".dependencies", ".build-dependencies"]
                .iter()
                .any(|t| h.ends_with(t) || h.contains(&format!("{t}.")))
    };
    plain(header) || targeted(header)
}

/// Every dependency declared in a Cargo.toml text, as `table: line`.
fn declared_dependencies(toml: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut table: Option<String> = None;
    for line in toml.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_start_matches('[');
            let header = header.trim_end_matches(']').trim().to_string();
            if is_dependency_table(&header) {
                // `[dependencies.tokio]` declares a dependency by itself.
                if !header.ends_with("dependencies") {
                    found.push(format!("[{header}]"));
                }
                table = Some(header);
            } else {
                table = None;
            }
            continue;
        }
        if let Some(table) = &table {
            if !table.ends_with("dependencies") {
                continue; // keys of a `[dependencies.NAME]` table
            }
            found.push(format!("[{table}] {line}"));
        }
    }
    found
}

#[test]
fn core_has_no_dependencies() {
    let path = crate_dir().join("Cargo.toml");
    let toml = fs::read_to_string(&path).expect("read Cargo.toml");
    assert!(
        toml.lines().any(|l| l.trim() == "[dependencies]"),
        "{}: expected an (empty) [dependencies] table",
        path.display()
    );
    let deps = declared_dependencies(&toml);
    assert!(
        deps.is_empty(),
        "fencelock-core must stay dependency-free (sans-IO, no serde, no runtime), \
         but {} declares: {deps:#?}",
        path.display()
    );
}

#[test]
fn dependency_check_catches_planted_dependencies() {
    let clean = "[package]\nname = \"x\"\n\n[dependencies]\n# none\n\n[dev-dependencies]\nproptest.workspace = true\n";
    assert_eq!(declared_dependencies(clean), Vec::<String>::new());
    let planted = [
        "[dependencies]\ntokio = \"1\"\n",
        "[dependencies]\nserde = { workspace = true }\n[dev-dependencies]\n",
        "[dependencies.rand]\nversion = \"0.8\"\n",
        "[build-dependencies]\ncc = \"1\"\n",
        "[target.'cfg(unix)'.dependencies]\nlibc = \"0.2\"\n",
        "[target.\"cfg(windows)\".dependencies.winapi]\nversion = \"0.3\"\n",
    ];
    for toml in planted {
        assert_eq!(declared_dependencies(toml).len(), 1, "missed in:\n{toml}");
    }
}

// ---------------------------------------------------------------------------------
// src/: no runtime, serialization, clock, I/O, threads or randomness.
// ---------------------------------------------------------------------------------

/// Identifiers the core must not name.
const FORBIDDEN_IDENTS: &[&str] = &[
    "tokio",
    "async_std",
    "serde",
    "Serialize",
    "Deserialize",
    "Instant",
    "SystemTime",
    "UNIX_EPOCH",
    "rand",
    "getrandom",
    "thread_rng",
];

/// `std::` (or `core::`) modules the core must not use.
const FORBIDDEN_STD_MODULES: &[&str] = &["time", "fs", "net", "thread", "io", "process", "env"];

/// `src` with comments and string/char literals blanked out (newlines kept, so
/// line numbers still match).
fn strip_comments_and_literals(src: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let prev_is_ident = i > 0 && is_ident(chars[i - 1]);
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            continue;
        }
        // Raw strings: r"..", r#".."#, br"..".
        if !prev_is_ident && (c == 'r' || (c == 'b' && next == Some('r'))) {
            let start = if c == 'b' { i + 2 } else { i + 1 };
            let mut j = start;
            while chars.get(j) == Some(&'#') {
                j += 1;
            }
            if chars.get(j) == Some(&'"') {
                let hashes = j - start;
                let mut k = j + 1;
                loop {
                    if k >= chars.len() {
                        break;
                    }
                    if chars[k] == '"' && (0..hashes).all(|h| chars.get(k + 1 + h) == Some(&'#')) {
                        k += 1 + hashes;
                        break;
                    }
                    k += 1;
                }
                for &ch in &chars[i..k.min(chars.len())] {
                    blank(&mut out, ch);
                }
                i = k;
                continue;
            }
        }
        if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
            continue;
        }
        if c == '\'' {
            // A char literal ('x', '\n', '\'', '\u{7f}'); otherwise a lifetime.
            let end = if next == Some('\\') {
                (i + 3..chars.len()).find(|&k| chars[k] == '\'')
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            if let Some(end) = end {
                for &ch in &chars[i..=end] {
                    blank(&mut out, ch);
                }
                i = end + 1;
                continue;
            }
        }
        out.push(c);
        i += 1;
    }
    out
}

/// Forbidden names in (stripped) code, as `(line, what)`.
fn forbidden_uses(code: &str) -> Vec<(usize, String)> {
    // Tokens: identifiers, `::`, and single punctuation characters.
    let mut tokens: Vec<(usize, String)> = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let (mut i, mut line) = (0, 1);
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push((line, chars[start..i].iter().collect()));
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push((line, "::".into()));
            i += 2;
        } else {
            tokens.push((line, c.to_string()));
            i += 1;
        }
    }

    let mut found = Vec::new();
    for (k, (line, tok)) in tokens.iter().enumerate() {
        if FORBIDDEN_IDENTS.contains(&tok.as_str()) {
            found.push((*line, tok.clone()));
        }
        let is_root = tok == "std" || tok == "core";
        if !is_root || tokens.get(k + 1).map(|t| t.1.as_str()) != Some("::") {
            continue;
        }
        match tokens.get(k + 2).map(|t| t.1.as_str()) {
            Some(module) if FORBIDDEN_STD_MODULES.contains(&module) => {
                found.push((*line, format!("{tok}::{module}")));
            }
            // `use std::{collections::HashMap, time::Instant};`: the first segment
            // of every item directly inside the braces.
            Some("{") => {
                let mut depth = 0;
                let mut at_item_start = true;
                for (l, t) in &tokens[k + 2..] {
                    match t.as_str() {
                        "{" => {
                            depth += 1;
                            at_item_start = depth == 1;
                            continue;
                        }
                        "}" => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        "," if depth == 1 => {
                            at_item_start = true;
                            continue;
                        }
                        module if at_item_start && FORBIDDEN_STD_MODULES.contains(&module) => {
                            found.push((*l, format!("{tok}::{{{module}}}")));
                        }
                        _ => {}
                    }
                    at_item_start = false;
                }
            }
            _ => {}
        }
    }
    found
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).expect("read src dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

#[test]
fn core_source_names_no_runtime_serde_clock_io_or_randomness() {
    let src = crate_dir().join("src");
    let files = rust_files(&src);
    assert!(
        files.iter().any(|f| f.ends_with("machine.rs")),
        "scanned the wrong folder: {files:?}"
    );
    let mut problems = Vec::new();
    for file in &files {
        let text = fs::read_to_string(file).expect("read source");
        for (line, what) in forbidden_uses(&strip_comments_and_literals(&text)) {
            problems.push(format!("{}:{line}: {what}", file.display()));
        }
    }
    assert!(
        problems.is_empty(),
        "fencelock-core must stay sans-IO (time and randomness are inputs), found:\n{}",
        problems.join("\n")
    );
}

#[test]
fn source_scan_catches_planted_uses() {
    let scan = |src: &str| -> Vec<String> {
        forbidden_uses(&strip_comments_and_literals(src))
            .into_iter()
            .map(|(_, what)| what)
            .collect()
    };
    let planted = [
        ("use std::time::Instant;", vec!["std::time", "Instant"]),
        (
            "use std::{collections::HashMap, time};",
            vec!["std::{time}"],
        ),
        ("use std::{fmt, net::{TcpStream}};", vec!["std::{net}"]),
        ("let f = std::fs::read(p);", vec!["std::fs"]),
        ("std::thread::sleep(d);", vec!["std::thread"]),
        ("use core::time::Duration;", vec!["core::time"]),
        ("#[derive(Debug, Serialize)]", vec!["Serialize"]),
        ("async fn f() { tokio::spawn(g()); }", vec!["tokio"]),
        ("let x: u8 = rand::random();", vec!["rand"]),
        (
            "fn f<'a>(s: &'a str) -> SystemTime { t }",
            vec!["SystemTime"],
        ),
        // A quote in a char literal does not start a string that hides code.
        ("let q = '\"'; let t = Instant::now();", vec!["Instant"]),
        (
            "let s = r#\"a \" b\"#; let t = Instant::now();",
            vec!["Instant"],
        ),
    ];
    for (src, want) in planted {
        assert_eq!(scan(src), want, "in: {src}");
    }
    let clean = [
        "// no Instant, no tokio, no std::time here",
        "/* serde? /* nested */ not here either: std::fs */",
        "/// Time is an input: no `std::time::Instant`.",
        "let m = \"tokio and serde are not used\";",
        "let m = r#\"std::net\"#;",
        "fn operand(random: u8, instant_ms: u64, time_ms: u64) {}",
        "use std::collections::{BTreeMap, HashMap}; use std::fmt;",
        "use std::{cmp, mem::take, ops::Bound};",
        "let c = '\\''; let d = '\\u{7f}'; fn f<'a>(x: &'a u8) {}",
    ];
    for src in clean {
        assert_eq!(scan(src), Vec::<String>::new(), "false alarm in: {src}");
    }
}
