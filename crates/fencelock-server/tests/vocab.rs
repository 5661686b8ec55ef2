//! One event vocabulary (issue 23, item 2): the audit log, watch, the dashboard and
//! metrics name each event the same way, from `fencelock_proto::vocab`, and no
//! other string literal for an event name is left in the server's (or the client
//! library's) source to drift from it.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use fencelock_core::{EventKind, GrantEnd, WaitEnd};
use fencelock_proto::vocab::{Event, OLD_AUDIT_NAMES};
use fencelock_server::audit::AuditKind;
use fencelock_server::metrics::Metrics;
use fencelock_server::watch_sse::kind_name;

fn core_kinds() -> Vec<EventKind> {
    let mut kinds = vec![
        EventKind::Granted,
        EventKind::Queued,
        EventKind::Downgraded,
        EventKind::Proclaimed,
    ];
    kinds.extend(
        [
            GrantEnd::Released,
            GrantEnd::Expired,
            GrantEnd::ForceReleased,
        ]
        .map(EventKind::Ended),
    );
    kinds.extend(
        [
            WaitEnd::TimedOut,
            WaitEnd::SessionEnded,
            WaitEnd::Cancelled,
            WaitEnd::ServerRestarted,
        ]
        .map(EventKind::WaitEnded),
    );
    kinds
}

#[test]
fn audit_watch_and_metrics_give_each_shared_event_the_same_name() {
    let watch: BTreeSet<&str> = core_kinds().into_iter().map(kind_name).collect();
    let audit: BTreeSet<&str> = AuditKind::ALL.iter().map(|k| k.as_str()).collect();
    let vocab: BTreeSet<&str> = Event::ALL.iter().map(|e| e.name()).collect();
    assert!(watch.is_subset(&vocab), "{watch:?}");
    assert!(audit.is_subset(&vocab), "{audit:?}");
    // The events both report: grants and their ends, downgrades, proclaims.
    let shared: BTreeSet<&str> = watch.intersection(&audit).copied().collect();
    assert_eq!(
        shared,
        BTreeSet::from([
            "downgraded",
            "expired",
            "force_released",
            "granted",
            "proclaimed",
            "released"
        ])
    );
    // Each audit kind with a watch counterpart has its name; a hand-off is `granted`.
    for k in AuditKind::ALL {
        if let Some(pb) = k.event().pb() {
            let name = core_kinds()
                .into_iter()
                .map(kind_name)
                .find(|n| Event::from_name(n).and_then(Event::pb) == Some(pb));
            assert_eq!(name, Some(k.as_str()), "{k:?}");
        }
    }
    assert_eq!(AuditKind::Handoff.as_str(), kind_name(EventKind::Granted));
    assert!(AuditKind::Handoff.is_handoff() && !AuditKind::Grant.is_handoff());
    // Metrics label each event with the watch name.
    let text = Metrics::default().render();
    let labels: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("fencelock_events_total{event=\""))
        .filter_map(|l| l.split('"').next())
        .collect();
    assert_eq!(labels, watch);
    // The old audit names are inputs only: none is an output name any more.
    for (old, event, _) in OLD_AUDIT_NAMES {
        assert!(
            !audit.contains(old) || old == event.name(),
            "{old} is still an output name"
        );
    }
}

/// A string literal naming an event (current or old audit name), or a `kind-NAME`
/// CSS class, outside the vocabulary.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Hit {
    file: String,
    line: usize,
    name: String,
}

/// Literals that are not event names though spelt like one: other vocabularies.
const ALLOWED: [(&str, &str, &str); 3] = [
    ("fencelock-server/src/error.rs", "expired", "the error code"),
    (
        "fencelock-server/src/audit.rs",
        "expired",
        "a session end's reason (closed or expired)",
    ),
    ("fencelock/src/codes.rs", "expired", "the error code"),
];

/// The event names in the source text of one file: every `"NAME"` literal and
/// `kind-NAME` class outside comments, up to its `mod tests` (tests may spell the
/// names out: they check the wire).
fn scan(file: &str, text: &str) -> Vec<Hit> {
    let mut names: Vec<&str> = Event::ALL.iter().map(|e| e.name()).collect();
    names.extend(OLD_AUDIT_NAMES.iter().map(|(old, _, _)| *old));
    let mut hits = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("mod tests") {
            break;
        }
        if code.starts_with("//") {
            continue;
        }
        for name in &names {
            let quoted = format!("\"{name}\"");
            let class = format!("kind-{name}");
            let class_hit = code.match_indices(&class).any(|(at, _)| {
                !code[at + class.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
            });
            if code.contains(&quoted) || class_hit {
                let allowed = ALLOWED
                    .iter()
                    .any(|(f, n, _)| file.ends_with(f) && n == name);
                if !allowed {
                    hits.push(Hit {
                        file: file.to_owned(),
                        line: i + 1,
                        name: (*name).to_owned(),
                    });
                }
            }
        }
    }
    hits
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("read source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_event_name_is_spelt_out_beside_the_vocabulary() {
    let crates = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&crates.join("fencelock-server/src"), &mut files);
    rust_files(&crates.join("fencelock/src"), &mut files);
    assert!(files.len() > 20, "found too few sources: {files:?}");
    let mut hits = Vec::new();
    for path in files {
        let text = fs::read_to_string(&path).expect("read source");
        let file = path.to_string_lossy().replace('\\', "/");
        hits.extend(scan(&file, &text));
    }
    assert!(
        hits.is_empty(),
        "event names spelt out instead of taken from fencelock_proto::vocab: {hits:#?}"
    );
}

#[test]
fn the_scan_catches_planted_names_and_skips_comments_tests_and_allowed_codes() {
    // The dashboard's old mapping, a planted copy of a watch name, and a CSS class.
    let planted = "fn kind(k: K) -> &str {\n    match k { K::F => \"forced_release\", K::G => \"granted\" }\n}\nconst CSS: &str = \".kind-expiry{color:red}\";\n";
    let hits: Vec<String> = scan("fencelock-server/src/dashboard.rs", planted)
        .into_iter()
        .map(|h| format!("{}:{}", h.line, h.name))
        .collect();
    assert_eq!(hits, ["2:granted", "2:forced_release", "4:expiry"]);
    let clean = "/// Shows `\"granted\"` rows.\n// \"expired\"\nfn f() {}\nmod tests {\n    const X: &str = \"granted\";\n}\n";
    assert!(scan("fencelock-server/src/x.rs", clean).is_empty());
    let code = "ApiErrorKind::Expired => \"expired\",\n";
    assert!(scan("crates/fencelock-server/src/error.rs", code).is_empty());
    assert_eq!(scan("crates/fencelock-server/src/http.rs", code).len(), 1);
    // `kind-granted_x` is not the class `kind-granted`.
    assert!(scan("a.rs", "\".kind-grantedly\"").is_empty());
}
