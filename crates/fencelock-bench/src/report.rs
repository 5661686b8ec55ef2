//! Turns the JSON lines of one invocation into the tables of `BENCHMARKS.md` (ratios
//! against each peer, the issue's targets, the checker's findings) and an SVG chart
//! (written by hand on purpose: a few bars of SVG do not need a plotting crate and
//! its build time).

use std::fmt::Write as _;

use serde_json::Value;

/// The target every ratio is taken against.
pub const BASE: &str = "fencelock";
/// The same server without fsync.
pub const BASE_NONE: &str = "fencelock-none";

/// One comparable figure: (workload, clients, field, higher-is-better, label).
const METRICS: &[(&str, u64, &str, bool, &str)] = &[
    ("W1", 1, "pair_p50_us", false, "W1 latency p50 (µs)"),
    ("W1", 1, "pair_p99_us", false, "W1 latency p99 (µs)"),
    ("W2", 16, "pairs_per_s", true, "W2 c=16 pairs/s"),
    ("W2", 64, "pairs_per_s", true, "W2 c=64 pairs/s"),
    ("W3", 16, "handoffs_per_s", true, "W3 c=16 hand-offs/s"),
    ("W3", 64, "handoffs_per_s", true, "W3 c=64 hand-offs/s"),
    ("W3", 64, "wait_p99_us", false, "W3 c=64 wait p99 (µs)"),
];

fn find<'a>(runs: &'a [Value], target: &str, workload: &str, clients: u64) -> Option<&'a Value> {
    runs.iter().find(|r| {
        r["target"] == target && r["workload"] == workload && r["clients"].as_u64() == Some(clients)
    })
}

fn metric(runs: &[Value], target: &str, workload: &str, clients: u64, field: &str) -> Option<f64> {
    find(runs, target, workload, clients)?[field].as_f64()
}

/// `base` relative to `peer`, oriented so that > 1 means fencelock is better.
fn ratio(base: f64, peer: f64, higher_better: bool) -> Option<f64> {
    let r = if higher_better {
        base / peer
    } else {
        peer / base
    };
    r.is_finite().then_some(r)
}

fn fmt_num(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// An integer figure, or a dash where the run predates it.
fn opt(v: &Value) -> String {
    v.as_u64().map_or_else(|| "–".to_owned(), |x| x.to_string())
}

fn targets_in_tier(runs: &[Value], tier: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in runs {
        if r["tier"] == tier && r["workload"].as_str().is_some_and(|w| w < "W4") {
            let t = r["target"].as_str().unwrap_or_default().to_owned();
            if !out.contains(&t) {
                out.push(t);
            }
        }
    }
    out
}

/// The comparison table of one durability tier, base first.
fn tier_table(runs: &[Value], tier: &str, base: &str, out: &mut String) {
    let targets = targets_in_tier(runs, tier);
    if targets.is_empty() {
        return;
    }
    let peers: Vec<&String> = targets.iter().filter(|t| *t != base).collect();
    let _ = write!(out, "| metric | {base} |");
    for p in &peers {
        let _ = write!(out, " {p} |");
    }
    out.push('\n');
    out.push_str(&"|---".repeat(peers.len() + 2));
    out.push_str("|\n");
    for &(w, c, field, higher, label) in METRICS {
        let b = metric(runs, base, w, c, field);
        let _ = write!(out, "| {label} | {} |", b.map_or("–".to_owned(), fmt_num));
        for p in &peers {
            let v = metric(runs, p, w, c, field);
            let cell = match (b, v) {
                (Some(b), Some(v)) => match ratio(b, v, higher) {
                    Some(r) => format!("{} (**{r:.1}×**)", fmt_num(v)),
                    None => fmt_num(v),
                },
                (_, Some(v)) => fmt_num(v),
                _ => "–".to_owned(),
            };
            let _ = write!(out, " {cell} |");
        }
        out.push('\n');
    }
}

/// The issue's targets, each with the measured ratio and whether it is met.
fn targets_table(runs: &[Value], out: &mut String) {
    out.push_str("| target | measured | met |\n|---|---|---|\n");
    let mut row = |name: &str, measured: Option<(f64, String)>, goal: f64| {
        let (cell, met) = match measured {
            Some((r, text)) => (text, if r >= goal { "yes" } else { "**no**" }),
            None => ("not measured".to_owned(), "–"),
        };
        let _ = writeln!(out, "| {name} | {cell} | {met} |");
    };
    let w2 = |peer: &str| {
        let b = metric(runs, BASE, "W2", 64, "pairs_per_s")?;
        let p = metric(runs, peer, "W2", 64, "pairs_per_s")?;
        Some((
            b / p,
            format!(
                "{:.2}× ({} vs {} pairs/s, c=64)",
                b / p,
                fmt_num(b),
                fmt_num(p)
            ),
        ))
    };
    row("W2 durable ≥ 10× etcd", w2("etcd"), 10.0);
    row("W2 durable ≥ 5× ZooKeeper", w2("zookeeper"), 5.0);
    row("W2 durable ≥ 3× PostgreSQL table", w2("pg-table"), 3.0);
    row("W2 durable ≥ ½ Redis without fsync", w2("redis"), 0.5);
    let w3 = (|| {
        let b = metric(runs, BASE, "W3", 64, "handoffs_per_s")?;
        let p = metric(runs, "zookeeper", "W3", 64, "handoffs_per_s")?;
        Some((
            b / p,
            format!(
                "{:.2}× ({} vs {} hand-offs/s, c=64)",
                b / p,
                fmt_num(b),
                fmt_num(p)
            ),
        ))
    })();
    row("W3 durable ≥ 5× ZooKeeper hand-offs", w3, 5.0);
    let server: Option<f64> = [16, 64]
        .iter()
        .map(|&c| metric(runs, BASE, "W3-server-fifo", c, "server_fifo_inversions"))
        .sum();
    let client: f64 = [16, 64]
        .iter()
        .filter_map(|&c| metric(runs, BASE, "W3", c, "fifo_inversions"))
        .sum();
    row(
        "W3 zero FIFO inversions",
        server.map(|n| {
            (
                if n == 0.0 { 1.0 } else { 0.0 },
                format!(
                    "{n:.0} in the server's event order; {client:.0} by client-side stamps (±{} ms)",
                    crate::checker::FIFO_SLACK.as_millis()
                ),
            )
        }),
        1.0,
    );
    let w1 = (|| {
        let b = metric(runs, BASE, "W1", 1, "pair_p50_us")?;
        let r = metric(runs, "redis", "W1", 1, "pair_p50_us")?;
        // "One fsync above Redis": Redis's own p50 plus one of the fsyncs its
        // AOF-always mode pays. A pair is two writes (SET, then the compare-and-delete
        // script), each fsynced before its reply, so one fsync is half of what AOF
        // adds to the pair.
        let fsync = (metric(runs, "redis-aof", "W1", 1, "pair_p50_us")? - r).max(0.0) / 2.0;
        let budget = r + fsync;
        Some((
            budget / b,
            format!("{b:.0} µs vs Redis {r:.0} µs + one fsync ({fsync:.0} µs: half of what AOF-always adds to Redis's pair of writes) = {budget:.0} µs"),
        ))
    })();
    row("W1 p50 ≤ Redis p50 + one fsync", w1, 1.0);
    let w4 = runs.iter().find(|r| r["workload"] == "W4").and_then(|r| {
        let alive = r["opened"].as_f64()? - r["lost"].as_f64()?;
        Some((
            alive / 100_000.0,
            format!("{alive:.0} sessions kept alive, {} lost", r["lost"]),
        ))
    });
    row("W4 ≥ 100,000 live sessions", w4, 1.0);
    let w5 = runs.iter().find(|r| r["workload"] == "W5").and_then(|r| {
        let s = r["ready_s"].as_f64()?;
        let locks = r["locks"].as_f64()?;
        let goal_s = 2.0 * locks / 1_000_000.0;
        Some((goal_s / s, format!("{s:.2} s with {locks:.0} locks")))
    });
    row("W5 ready ≤ 2 s with 1M locks", w5, 1.0);
    for (peer, label) in [
        ("etcd", "W6 ≥ 3× etcd grants/s"),
        ("zookeeper", "W6 ≥ 3× ZooKeeper grants/s"),
    ] {
        let w6 = (|| {
            let b = w6_figure(runs, BASE, "grants_per_s")?;
            let p = w6_figure(runs, peer, "grants_per_s")?;
            Some((
                b / p,
                format!("{:.2}× ({} vs {} grants/s)", b / p, fmt_num(b), fmt_num(p)),
            ))
        })();
        row(label, w6, 3.0);
    }
}

fn w6_figure(runs: &[Value], target: &str, field: &str) -> Option<f64> {
    runs.iter()
        .find(|r| r["target"] == target && r["workload"] == "W6")?[field]
        .as_f64()
}

fn election_figure(runs: &[Value], target: &str, field: &str) -> Option<f64> {
    runs.iter()
        .find(|r| r["target"] == target && r["workload"] == "election")?[field]
        .as_f64()
}

/// The stores of W6 and the election failover, base first.
const ISSUE_22_TARGETS: &[&str] = &["fencelock", "etcd", "zookeeper"];

/// W6 columns: (field, higher is better, heading).
const W6_FIELDS: &[(&str, bool, &str)] = &[
    ("grants_per_s", true, "grants/s"),
    ("shared_per_s", true, "shared/s"),
    ("exclusive_per_s", true, "exclusive/s"),
    ("shared_pair_p50_us", false, "shared p50 (µs)"),
    ("shared_pair_p99_us", false, "shared p99 (µs)"),
    ("exclusive_pair_p50_us", false, "exclusive p50 (µs)"),
    ("exclusive_pair_p99_us", false, "exclusive p99 (µs)"),
];

/// Election columns: (field, heading); lower is better for all.
const ELECTION_FIELDS: &[(&str, &str)] = &[
    ("failover_p50_ms", "kill → fenced write p50 (ms)"),
    ("failover_p99_ms", "p99 (ms)"),
    ("leading_p50_ms", "kill → leading p50 (ms)"),
];

/// The tables of W6 and the election failover over one or more runs (one `Vec` of JSON
/// lines per run): each figure is the median over the runs, each ratio the median of
/// the ratios taken within each run (every run's ratio shown), oriented so that > 1
/// means fencelock is better. Empty if no run has either workload.
pub fn issue22_markdown(files: &[Vec<Value>]) -> String {
    let mut out = String::new();
    let runs = files.len();
    let median_of = |f: &dyn Fn(&[Value]) -> Option<f64>| {
        let all: Vec<f64> = files.iter().filter_map(|r| f(r)).collect();
        (median(all.clone()), all)
    };
    let cell = |v: Option<f64>| v.map_or("–".to_owned(), fmt_num);
    let ratio_cell = |(m, all): (Option<f64>, Vec<f64>)| match m {
        None => "–".to_owned(),
        Some(m) if all.len() > 1 => format!(
            "{m:.2}× ({})",
            all.iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Some(m) => format!("{m:.2}×"),
    };
    if let Some(first) = files.iter().flatten().find(|r| r["workload"] == "W6") {
        let shared = first["shared_percent"].as_u64().unwrap_or(0);
        let _ = writeln!(
            out,
            "### W6 read-mostly: {} clients on one key, {shared} % shared / {} % exclusive\n\n\
             Median of {runs} run(s); latency is acquire + release per mode.\n",
            first["clients"],
            100 - shared.min(100)
        );
        out.push_str("| target |");
        for (_, _, h) in W6_FIELDS {
            let _ = write!(out, " {h} |");
        }
        out.push_str(" overlaps / fence decreases | errors |\n|---|");
        out.push_str(&"---|".repeat(W6_FIELDS.len() + 2));
        out.push('\n');
        for t in ISSUE_22_TARGETS {
            if !files
                .iter()
                .flatten()
                .any(|r| r["target"] == *t && r["workload"] == "W6")
            {
                continue;
            }
            let _ = write!(out, "| {t} |");
            for (field, _, _) in W6_FIELDS {
                let _ = write!(out, " {} |", cell(median_of(&|r| w6_figure(r, t, field)).0));
            }
            let sum = |f: &str| {
                files
                    .iter()
                    .flatten()
                    .filter(|r| r["target"] == *t && r["workload"] == "W6")
                    .filter_map(|r| r[f].as_u64())
                    .sum::<u64>()
            };
            let _ = writeln!(
                out,
                " {} / {} | {} |",
                sum("overlaps"),
                sum("fence_decreases"),
                sum("errors")
            );
        }
        for peer in &ISSUE_22_TARGETS[1..] {
            let _ = write!(out, "| fencelock vs {peer} |");
            for &(field, higher, _) in W6_FIELDS {
                let r = median_of(&|r| {
                    ratio(
                        w6_figure(r, BASE, field)?,
                        w6_figure(r, peer, field)?,
                        higher,
                    )
                });
                let _ = write!(out, " {} |", ratio_cell(r));
            }
            out.push_str(" | |\n");
        }
    }
    if files.iter().flatten().any(|r| r["workload"] == "election") {
        let ttl = files
            .iter()
            .flatten()
            .find(|r| r["workload"] == "election")
            .and_then(|r| r["ttl_ms"].as_u64())
            .unwrap_or(0);
        let _ = writeln!(
            out,
            "\n### Election failover: the leading candidate process killed (`kill -9`)\n\n\
             Three candidate processes, lease {ttl} ms for every store; median of {runs} \
             run(s) of each figure (each run's p50/p99 over its rounds).\n"
        );
        out.push_str("| target |");
        for (_, h) in ELECTION_FIELDS {
            let _ = write!(out, " {h} |");
        }
        out.push_str(" rounds | timeouts | refused writes / terms not increasing |\n|---|");
        out.push_str(&"---|".repeat(ELECTION_FIELDS.len() + 3));
        out.push('\n');
        for t in ISSUE_22_TARGETS {
            let mine: Vec<&Value> = files
                .iter()
                .flatten()
                .filter(|r| r["target"] == *t && r["workload"] == "election")
                .collect();
            if mine.is_empty() {
                continue;
            }
            let _ = write!(out, "| {t} |");
            for (field, _) in ELECTION_FIELDS {
                let _ = write!(
                    out,
                    " {} |",
                    cell(median_of(&|r| election_figure(r, t, field)).0)
                );
            }
            let sum = |f: &str| mine.iter().filter_map(|r| r[f].as_u64()).sum::<u64>();
            let _ = writeln!(
                out,
                " {} | {} | {} |",
                sum("rounds"),
                sum("timeouts"),
                sum("election_violations")
            );
        }
        for peer in &ISSUE_22_TARGETS[1..] {
            let _ = write!(out, "| fencelock vs {peer} |");
            for (field, _) in ELECTION_FIELDS {
                let r = median_of(&|r| {
                    ratio(
                        election_figure(r, BASE, field)?,
                        election_figure(r, peer, field)?,
                        false,
                    )
                });
                let _ = write!(out, " {} |", ratio_cell(r));
            }
            out.push_str(" | | |\n");
        }
    }
    out
}

/// What W3 can reach at all while every grant is durable before it is acknowledged
/// (docs/design.md, Invariant 3), from this run's own figures, or `None` if the run lacks
/// them.
///
/// A hand-off is serial: the grant's fdatasync must complete before the new holder
/// hears of it, and its release (which starts the next hand-off's fdatasync) cannot
/// come before that. So one hand-off takes at least one fdatasync plus what a
/// hand-off costs without any disk. The second term is taken as the fastest W3
/// hand-off of any memory-tier target in the same run (the best stack this machine
/// showed), and the first as the fencelock server's own mean fdatasync in its W3
/// run, so the ceiling is optimistic for fencelock, never pessimistic.
fn w3_ceiling(runs: &[Value]) -> Option<String> {
    let clients = 64;
    let sync_us = metric(runs, BASE, "W3", clients, "log_sync_mean_us")?;
    let (fastest, rate) = runs
        .iter()
        .filter(|r| r["tier"] == "memory" && r["workload"] == "W3")
        .filter(|r| r["clients"].as_u64() == Some(clients))
        .filter_map(|r| Some((r["target"].as_str()?, r["handoffs_per_s"].as_f64()?)))
        .filter(|(_, rate)| *rate > 0.0)
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    let stack_us = 1e6 / rate;
    let ceiling = 1e6 / (sync_us + stack_us);
    let zk = metric(runs, "zookeeper", "W3", clients, "handoffs_per_s")
        .filter(|zk| *zk > 0.0)
        .map_or_else(String::new, |zk| {
            format!(
                " = **{:.2}× ZooKeeper** ({} hand-offs/s), against a target of 5×",
                ceiling / zk,
                fmt_num(zk)
            )
        });
    let ours = metric(runs, BASE, "W3", clients, "handoffs_per_s").map_or_else(String::new, |b| {
        format!(
            "; fencelock reached {} hand-offs/s, {:.0} % of it",
            fmt_num(b),
            100.0 * b / ceiling
        )
    });
    Some(format!(
        "**W3 ceiling with one fdatasync per hand-off** (c={clients}; a grant is durable before \
         it is acknowledged, and the next release can only follow it): 1 / ({sync_us:.0} µs, \
         the server's mean fdatasync in its W3 run + {stack_us:.0} µs, the fastest hand-off \
         without any fsync in this run, {fastest}) = {ceiling:.0} hand-offs/s{zk}{ours}.\n"
    ))
}

fn violations_table(runs: &[Value], out: &mut String) {
    out.push_str("| target | runs | overlaps | fence decreases | FIFO inversions (W3) | errors |\n|---|---|---|---|---|---|\n");
    let mut targets: Vec<&str> = Vec::new();
    for r in runs {
        if let Some(t) = r["target"].as_str() {
            let checked = r["workload"]
                .as_str()
                .is_some_and(|w| matches!(w, "W1" | "W2" | "W3" | "W6"));
            if !targets.contains(&t) && checked {
                targets.push(t);
            }
        }
    }
    for t in targets {
        let mine: Vec<&Value> = runs.iter().filter(|r| r["target"] == t).collect();
        let sum = |f: &str| mine.iter().filter_map(|r| r[f].as_u64()).sum::<u64>();
        let _ = writeln!(
            out,
            "| {t} | {} | {} | {} | {} | {} |",
            mine.len(),
            sum("overlaps"),
            sum("fence_decreases"),
            sum("fifo_inversions"),
            sum("errors")
        );
    }
}

/// The base of the cluster tier.
pub const CLUSTER_BASE: &str = "fencelock-3";
/// The cluster tier's peers, in table order.
const CLUSTER_PEERS: &[&str] = &["etcd-3", "zk-3"];

/// The median of some figures (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// One row per failover record: the kill-to-grant times and what the load saw.
fn failover_table(records: &[&Value], out: &mut String) {
    out.push_str("| target | kills | kill → grant on a new key p50 / max (ms) | probe timeouts | restart → healthy p50 (s) | load pairs / errors | overlaps / fence decreases |\n|---|---|---|---|---|---|---|\n");
    for r in records.iter().filter(|r| r["workload"] == "failover") {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} / {:.0} | {} | {:.1} | {} / {} | {} / {} |",
            r["target"].as_str().unwrap_or(""),
            r["kills"],
            r["failover_p50_ms"].as_f64().unwrap_or(f64::NAN),
            r["failover_max_ms"].as_f64().unwrap_or(f64::NAN),
            r["timeouts"],
            r["heal_p50_s"].as_f64().unwrap_or(f64::NAN),
            r["load_pairs"],
            r["load_errors"],
            r["overlaps"],
            r["fence_decreases"]
        );
    }
}

/// The "Cluster (3 members)" tables from several runs (one `Vec` of JSON lines per
/// run): each figure's median over the runs, and each peer's ratio as the median of
/// the ratios taken within each run (with every run's ratio, to show the spread).
pub fn cluster_markdown(files: &[Vec<Value>]) -> String {
    let mut out = String::new();
    // Runs with W1–W3 figures (a failover-only run adds none).
    let n = files
        .iter()
        .filter(|runs| runs.iter().any(|r| r["workload"] == "W2"))
        .count();
    let values = |target: &str, w: &str, c: u64, field: &str| -> Vec<f64> {
        files
            .iter()
            .filter_map(|runs| metric(runs, target, w, c, field))
            .collect()
    };
    let ratios = |peer: &str, w: &str, c: u64, field: &str, higher: bool| -> Vec<f64> {
        files
            .iter()
            .filter_map(|runs| {
                let b = metric(runs, CLUSTER_BASE, w, c, field)?;
                let p = metric(runs, peer, w, c, field)?;
                ratio(b, p, higher)
            })
            .collect()
    };
    let _ = write!(out, "| metric (median of {n} runs) | {CLUSTER_BASE} |");
    for p in CLUSTER_PEERS {
        let _ = write!(out, " {p} | ratio (each run) |");
    }
    out.push('\n');
    out.push_str(&"|---".repeat(2 + 2 * CLUSTER_PEERS.len()));
    out.push_str("|\n");
    for &(w, c, field, higher, label) in METRICS {
        let b = median(values(CLUSTER_BASE, w, c, field));
        let _ = write!(out, "| {label} | {} |", b.map_or("–".to_owned(), fmt_num));
        for p in CLUSTER_PEERS {
            let v = median(values(p, w, c, field));
            let rs = ratios(p, w, c, field, higher);
            let each: Vec<String> = rs.iter().map(|r| format!("{r:.2}")).collect();
            let cell = match median(rs.clone()) {
                Some(m) => format!("**{m:.2}×** ({})", each.join(" / ")),
                None => "–".to_owned(),
            };
            let _ = write!(out, " {} | {cell} |", v.map_or("–".to_owned(), fmt_num));
        }
        out.push('\n');
    }
    // Safety and order, summed over every run.
    let sum = |target: &str, pred: &dyn Fn(&Value) -> bool, field: &str| -> u64 {
        files
            .iter()
            .flatten()
            .filter(|r| r["target"] == target && pred(r))
            .filter_map(|r| r[field].as_u64())
            .sum()
    };
    let w123 = |r: &Value| r["workload"].as_str().is_some_and(|w| w < "W4");
    let w3 = |r: &Value| r["workload"] == "W3";
    let _ = write!(
        out,
        "| W3 FIFO inversions, client-side (sum) | {} |",
        sum(CLUSTER_BASE, &w3, "fifo_inversions")
    );
    for p in CLUSTER_PEERS {
        let _ = write!(out, " {} | |", sum(p, &w3, "fifo_inversions"));
    }
    out.push('\n');
    let _ = write!(
        out,
        "| overlaps / fence decreases / errors (sum) | {} / {} / {} |",
        sum(CLUSTER_BASE, &w123, "overlaps"),
        sum(CLUSTER_BASE, &w123, "fence_decreases"),
        sum(CLUSTER_BASE, &w123, "errors")
    );
    for p in CLUSTER_PEERS {
        let _ = write!(
            out,
            " {} / {} / {} | |",
            sum(p, &w123, "overlaps"),
            sum(p, &w123, "fence_decreases"),
            sum(p, &w123, "errors")
        );
    }
    out.push('\n');
    let server_fifo = |r: &Value| r["workload"] == "W3-server-fifo";
    let server_inversions = sum(CLUSTER_BASE, &server_fifo, "server_fifo_inversions");
    let audits = files
        .iter()
        .flatten()
        .filter(|r| r["target"] == CLUSTER_BASE && server_fifo(r))
        .count();
    let incomplete = files
        .iter()
        .flatten()
        .filter(|r| r["target"] == CLUSTER_BASE && server_fifo(r) && r["incomplete"] == true)
        .count();
    let _ = writeln!(
        out,
        "\nfencelock-3's W3 order on the leader's event stream: {server_inversions} inversions in {audits} audits ({incomplete} incomplete)."
    );

    let failovers: Vec<&Value> = files
        .iter()
        .flatten()
        .filter(|r| r["workload"] == "failover")
        .collect();
    if !failovers.is_empty() {
        out.push('\n');
        failover_table(&failovers, &mut out);
    }

    // The issue's targets for the cluster tier.
    out.push_str("\n| target | measured (median of runs) | met |\n|---|---|---|\n");
    let mut row = |name: &str, measured: Option<(f64, String)>, goal: f64| {
        let (cell, met) = match measured {
            Some((r, text)) if r >= goal => (text, "yes".to_owned()),
            Some((r, text)) => (
                text,
                format!("**no** ({:.0} % of the goal)", 100.0 * r / goal),
            ),
            None => ("not measured".to_owned(), "–".to_owned()),
        };
        let _ = writeln!(out, "| {name} | {cell} | {met} |");
    };
    let by_ratio = |peer: &str, w: &str, c: u64, field: &str| {
        let m = median(ratios(peer, w, c, field, true))?;
        Some((m, format!("{m:.2}× (c={c})")))
    };
    row(
        "W2 ≥ 3× etcd-3",
        by_ratio("etcd-3", "W2", 64, "pairs_per_s"),
        3.0,
    );
    row(
        "W2 ≥ 2× zk-3",
        by_ratio("zk-3", "W2", 64, "pairs_per_s"),
        2.0,
    );
    row(
        "W3 ≥ 2× zk-3 hand-offs",
        by_ratio("zk-3", "W3", 64, "handoffs_per_s"),
        2.0,
    );
    let client_fifo = sum(CLUSTER_BASE, &w3, "fifo_inversions");
    row(
        "W3 zero FIFO inversions",
        (audits > 0).then(|| {
            (
                if server_inversions == 0 && incomplete == 0 { 1.0 } else { 0.0 },
                format!("{server_inversions} on the leader's event stream; {client_fifo} by client-side stamps"),
            )
        }),
        1.0,
    );
    let p50 = |t: &str| {
        median(
            failovers
                .iter()
                .filter(|r| r["target"] == t)
                .filter_map(|r| r["failover_p50_ms"].as_f64())
                .collect(),
        )
    };
    row(
        "failover p50 ≤ 1 s",
        p50(CLUSTER_BASE).map(|ms| (1000.0 / ms, format!("{ms:.0} ms"))),
        1.0,
    );
    for peer in CLUSTER_PEERS {
        let measured = p50(CLUSTER_BASE)
            .zip(p50(peer))
            .map(|(b, p)| (p / b, format!("{b:.0} ms vs {p:.0} ms ({:.2}×)", p / b)));
        row(&format!("failover p50 better than {peer}"), measured, 1.0);
    }
    out
}

/// The markdown tables for `BENCHMARKS.md`.
pub fn markdown(runs: &[Value]) -> String {
    let mut out = String::new();
    // A cluster-only run has no single-node tiers: no empty headings then.
    let single = runs.iter().any(|r| {
        (r["tier"] == "fsync" || r["tier"] == "memory")
            && r["workload"] != "W6"
            && r["workload"] != "election"
    });
    if single {
        out.push_str("### Durable tier (fsync before acknowledging)\n\nRatios: fencelock's figure against the peer's, > 1 means fencelock is better (more per second, or less latency).\n\n");
        tier_table(runs, "fsync", BASE, &mut out);
        out.push_str("\n### Memory tier (no fsync)\n\n");
        tier_table(runs, "memory", BASE_NONE, &mut out);
    }
    if runs.iter().any(|r| r["tier"] == "cluster") {
        if !targets_in_tier(runs, "cluster").is_empty() {
            out.push_str("\n### Cluster tier (3 members, every member fsyncs)\n\nRatios: fencelock-3's figure against the peer's, > 1 means fencelock-3 is better.\n\n");
            tier_table(runs, "cluster", CLUSTER_BASE, &mut out);
        }
        if runs.iter().any(|r| r["workload"] == "failover") {
            out.push_str("\n### Failover: the leader killed (`kill -9`) under W2 load\n\n");
            failover_table(&runs.iter().collect::<Vec<_>>(), &mut out);
        }
    }
    let issue22 = issue22_markdown(&[runs.to_vec()]);
    if !issue22.is_empty() {
        out.push('\n');
        out.push_str(&issue22);
    }
    if runs.iter().any(|r| r["target"] == BASE) {
        out.push_str("\n### The issue's targets\n\n");
        targets_table(runs, &mut out);
    }
    if let Some(text) = w3_ceiling(runs) {
        out.push('\n');
        out.push_str(&text);
    }
    out.push_str("\n### What the online checker saw (all runs)\n\n");
    violations_table(runs, &mut out);
    out.push_str("\n### Every run\n\n| target | tier | workload | clients | pairs/s | hand-offs/s | pair p50 / p99 / p99.9 (µs) | wait p50 / p99 (µs) | errors |\n|---|---|---|---|---|---|---|---|---|\n");
    for r in runs.iter().filter(|r| r["pairs"].is_u64()) {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {} / {} / {} | {} / {} | {} |",
            r["target"].as_str().unwrap_or(""),
            r["tier"].as_str().unwrap_or(""),
            r["workload"].as_str().unwrap_or(""),
            r["clients"],
            r["pairs_per_s"].as_f64().unwrap_or(0.0),
            r["handoffs_per_s"].as_f64().unwrap_or(0.0),
            r["pair_p50_us"],
            r["pair_p99_us"],
            r["pair_p999_us"],
            r["wait_p50_us"],
            r["wait_p99_us"],
            r["errors"]
        );
    }
    for r in runs.iter().filter(|r| r["error"].is_string()) {
        let _ = writeln!(out, "\n**{} failed**: {}", r["target"], r["error"]);
    }
    let fifo: Vec<&Value> = runs
        .iter()
        .filter(|r| r["workload"] == "W3-server-fifo")
        .collect();
    if !fifo.is_empty() {
        out.push_str("\n### W3 FIFO order on the server's event stream (fencelock)\n\n| target | clients | grants seen | inversions | audit complete |\n|---|---|---|---|---|\n");
        for r in fifo {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                r["target"].as_str().unwrap_or(""),
                r["clients"],
                r["grants_seen"],
                r["server_fifo_inversions"],
                if r["incomplete"] == true { "no" } else { "yes" }
            );
        }
    }
    if let Some(r) = runs.iter().find(|r| r["workload"] == "W4") {
        let _ = write!(
            out,
            "\n### W4: sessions on one fencelock node\n\n| sessions | TTL | lost | keep-alives/s | keep-alive p50 / p99 / max | longest unrenewed | server CPU | server RSS | expiry lateness p50 / p99 / max | expiries missed |\n|---|---|---|---|---|---|---|---|---|---|\n| {} | {} ms | {} | {:.0} | {} / {} / {} µs | {:.2} s | {:.2} cores | {:.0} MiB | {} / {} / {} ms | {} |\n",
            r["opened"],
            r["ttl_ms"],
            r["lost"],
            r["keepalives_per_s"].as_f64().unwrap_or(0.0),
            opt(&r["keepalive_p50_us"]),
            opt(&r["keepalive_p99_us"]),
            opt(&r["keepalive_max_us"]),
            r["max_renew_gap_s"].as_f64().unwrap_or(0.0),
            r["server_cpu_cores"].as_f64().unwrap_or(0.0),
            r["server_rss_mib"].as_f64().unwrap_or(0.0),
            r["expiry_late_p50_ms"],
            r["expiry_late_p99_ms"],
            r["expiry_late_max_ms"],
            r["expiry_missing"]
        );
    }
    if let Some(r) = runs.iter().find(|r| r["workload"] == "W5") {
        let _ = write!(
            out,
            "\n### W5: kill -9 and restart with held locks\n\n| locks held | fill rate | RSS before | data dir | ready after | max fence before | first fence after | spot checks lost/changed |\n|---|---|---|---|---|---|---|---|\n| {} | {:.0}/s | {:.0} MiB | {:.0} MiB | {:.2} s | {} | {} | {} |\n",
            r["locks"],
            r["fill_per_s"].as_f64().unwrap_or(0.0),
            r["rss_before_mib"].as_f64().unwrap_or(0.0),
            r["data_mib"].as_f64().unwrap_or(0.0),
            r["ready_s"].as_f64().unwrap_or(0.0),
            r["max_fence_before"],
            r["first_fence_after"],
            r["lost_or_changed"]
        );
    }
    out
}

/// A horizontal bar chart of W2 c=64 pairs/s and W3 c=64 hand-offs/s per target,
/// colored by tier.
pub fn svg(runs: &[Value]) -> String {
    let panels = [
        (
            "W2",
            64,
            "pairs_per_s",
            "W2: acquire+release pairs/s, 64 clients, distinct keys",
        ),
        (
            "W3",
            64,
            "handoffs_per_s",
            "W3: hand-offs/s, 64 clients, one key",
        ),
    ];
    let mut targets: Vec<(String, String)> = Vec::new();
    for r in runs {
        if let (Some(t), Some(tier)) = (r["target"].as_str(), r["tier"].as_str()) {
            if r["workload"] == "W2" && !targets.iter().any(|(x, _)| x == t) {
                targets.push((t.to_owned(), tier.to_owned()));
            }
        }
    }
    let (width, label_w, bar_h, gap) = (860.0, 190.0, 18.0, 6.0);
    let panel_h = 40.0 + targets.len() as f64 * (bar_h + gap);
    let height = 30.0 + panel_h * panels.len() as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r##"<text x="10" y="18" font-size="11" fill="#555">dark = fsync'd tier, light = memory tier; same machine, same run</text>"##
    );
    for (i, (w, c, field, title)) in panels.iter().enumerate() {
        let top = 30.0 + i as f64 * panel_h;
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}" font-weight="bold">{title}</text>"#,
            top + 16.0
        );
        let values: Vec<f64> = targets
            .iter()
            .map(|(t, _)| metric(runs, t, w, *c, field).unwrap_or(0.0))
            .collect();
        let max = values.iter().cloned().fold(1.0, f64::max);
        for (j, ((t, tier), v)) in targets.iter().zip(&values).enumerate() {
            let y = top + 28.0 + j as f64 * (bar_h + gap);
            let len = (width - label_w - 90.0) * v / max;
            let color = match (t.starts_with("fencelock"), tier.as_str()) {
                (true, "fsync") => "#1f6f3f",
                (true, _) => "#7cc797",
                (false, "fsync") => "#34558b",
                (false, _) => "#9fb6dc",
            };
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{t}</text><rect x="{label_w}" y="{y}" width="{len:.1}" height="{bar_h}" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
                label_w - 6.0,
                y + 13.0,
                label_w + len + 4.0,
                y + 13.0,
                fmt_num(*v)
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cluster_run(fl: f64, etcd: f64, zk: f64) -> Vec<Value> {
        [("fencelock-3", fl), ("etcd-3", etcd), ("zk-3", zk)]
            .iter()
            .map(|(t, v)| json!({"target": t, "tier": "cluster", "workload": "W2", "clients": 64, "pairs_per_s": v}))
            .collect()
    }

    #[test]
    fn cluster_ratios_are_the_median_of_each_run_s_own_ratio() {
        // zk-3's per-run ratios are 2, 5 and 1.5: their median is 2, while the ratio
        // of the figures' medians (300 / 100) would be 3.
        let files = vec![
            cluster_run(200.0, 100.0, 100.0),
            cluster_run(400.0, 200.0, 80.0),
            cluster_run(300.0, 50.0, 200.0),
        ];
        let md = cluster_markdown(&files);
        assert!(md.contains("**2.00×** (2.00 / 5.00 / 1.50)"), "{md}");
        assert!(md.contains("| W2 ≥ 2× zk-3 | 2.00× (c=64) | yes |"), "{md}");
        // etcd-3: ratios 2, 2 and 6, median 2: short of the 3× goal.
        assert!(
            md.contains("| W2 ≥ 3× etcd-3 | 2.00× (c=64) | **no** (67 % of the goal) |"),
            "{md}"
        );
        assert_eq!(median(vec![3.0, 1.0, f64::NAN, 2.0]), Some(2.0));
        assert_eq!(median(vec![1.0, 4.0]), Some(2.5));
        assert_eq!(median(Vec::new()), None);
    }

    fn runs() -> Vec<Value> {
        vec![
            json!({"target": "fencelock", "tier": "fsync", "workload": "W2", "clients": 64, "pairs_per_s": 40000.0}),
            json!({"target": "etcd", "tier": "fsync", "workload": "W2", "clients": 64, "pairs_per_s": 2000.0, "overlaps": 0, "fence_decreases": 3}),
            json!({"target": "redis", "tier": "memory", "workload": "W2", "clients": 64, "pairs_per_s": 100000.0}),
        ]
    }

    #[test]
    fn ratio_is_oriented_so_that_more_is_better() {
        let md = markdown(&runs());
        assert!(md.contains("2000 (**20.0×**)"), "{md}");
        assert!(
            md.contains("| W2 durable ≥ 10× etcd | 20.00× (40000 vs 2000 pairs/s, c=64) | yes |"),
            "{md}"
        );
        assert!(md.contains("| W2 durable ≥ ½ Redis without fsync | 0.40× (40000 vs 100000 pairs/s, c=64) | **no** |"), "{md}");
        assert!(md.contains("| etcd | 1 | 0 | 3 |"), "{md}");
    }

    #[test]
    fn w4_row_shows_keepalive_latency_or_a_dash_for_older_runs() {
        let w4 = |extra: Value| {
            let mut r = json!({"workload": "W4", "opened": 100000, "ttl_ms": 10000, "lost": 0,
                "keepalives_per_s": 20000.0, "max_renew_gap_s": 5.1, "server_cpu_cores": 0.9,
                "server_rss_mib": 68.0, "expiry_late_p50_ms": 0, "expiry_late_p99_ms": 2,
                "expiry_late_max_ms": 3, "expiry_missing": 0});
            for (k, v) in extra.as_object().expect("object") {
                r[k] = v.clone();
            }
            markdown(&[r])
        };
        let md = w4(
            json!({"keepalive_p50_us": 900, "keepalive_p99_us": 4100, "keepalive_max_us": 9000}),
        );
        assert!(
            md.contains("| 100000 | 10000 ms | 0 | 20000 | 900 / 4100 / 9000 µs | 5.10 s |"),
            "{md}"
        );
        let md = w4(json!({}));
        assert!(md.contains("| 20000 | – / – / – µs | 5.10 s |"), "{md}");
    }

    #[test]
    fn w1_budget_is_redis_plus_one_of_the_two_fsyncs_of_its_pair() {
        let w1 = |target: &str, tier: &str, p50: u64| json!({"target": target, "tier": tier, "workload": "W1", "clients": 1, "pair_p50_us": p50});
        let md = |ours: u64| {
            markdown(&[
                w1("fencelock", "fsync", ours),
                w1("redis", "memory", 140),
                w1("redis-aof", "fsync", 380),
            ])
        };
        // 140 + (380 - 140) / 2 = 260.
        assert!(md(260).contains("= 260 µs | yes |"), "{}", md(260));
        assert!(md(261).contains("= 260 µs | **no** |"), "{}", md(261));
    }

    #[test]
    fn w3_ceiling_adds_the_server_s_fdatasync_to_the_fastest_hand_off_without_one() {
        let w3 = |target: &str, tier: &str, rate: f64, extra: Value| {
            let mut r = json!({"target": target, "tier": tier, "workload": "W3", "clients": 64,
                "handoffs_per_s": rate});
            for (k, v) in extra.as_object().expect("object") {
                r[k] = v.clone();
            }
            r
        };
        let runs = vec![
            w3(
                "fencelock",
                "fsync",
                3000.0,
                json!({"log_sync_mean_us": 100}),
            ),
            w3("fencelock-none", "memory", 8000.0, json!({})),
            // 10,000/s: 100 µs a hand-off, the fastest without fsync.
            w3("pg-advisory", "memory", 10000.0, json!({})),
            w3("zookeeper", "fsync", 1000.0, json!({})),
        ];
        let md = markdown(&runs);
        // 1 / (100 µs + 100 µs) = 5,000/s = 5× ZooKeeper's 1,000/s; 3,000 is 60 % of it.
        assert!(
            md.contains("1 / (100 µs, the server's mean fdatasync in its W3 run + 100 µs, the fastest hand-off without any fsync in this run, pg-advisory) = 5000 hand-offs/s = **5.00× ZooKeeper** (1000 hand-offs/s), against a target of 5×; fencelock reached 3000 hand-offs/s, 60 % of it."),
            "{md}"
        );
        // Without the server's fdatasync figure (older runs) there is no ceiling.
        let mut older = runs.clone();
        older[0] = w3("fencelock", "fsync", 3000.0, json!({}));
        assert!(!markdown(&older).contains("W3 ceiling"));
    }

    #[test]
    fn svg_has_a_bar_per_target() {
        let svg = svg(&runs());
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<rect x=").count(), 6);
    }
}
