//! The printed tables and summary lines.

use rlsd_testkit::workload::Shape;

use crate::ceiling::Ceiling;
use crate::opts::Opts;
use crate::phases::{Phase, median};
use crate::uses_redis;

pub(crate) struct Row {
    pub(crate) phase: String,
    pub(crate) server: &'static str,
    pub(crate) result: Phase,
}

pub(crate) fn print_rows(rows: &[Row], shared_runtime: bool) {
    println!(
        "| {:<30} | {:<10} | {:>9} | {:>7} | {:>7} | {:>7} | {:>7} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>13} | {:>13} | {:>22} |",
        "phase",
        "server",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "max ms",
        "lag p99",
        "OK",
        "OVER",
        "wrong",
        "errors",
        "srv CPU µs/req",
        "cli CPU µs/req",
        "Redis CPU µs/req, /call"
    );
    println!(
        "|{:-<32}|{:-<12}|{:->11}|{:->9}|{:->9}|{:->9}|{:->9}|{:->9}|{:->11}|{:->8}|{:->7}|{:->8}|{:->15}|{:->15}|{:->24}|",
        "", "", "", "", "", "", "", "", "", "", "", "", "", "", ""
    );
    for row in rows {
        let r = &row.result;
        let l = &r.latencies_us;
        let n = l.len().max(1) as f64;
        let cpu_cell = |cpu: f64, share: f64| {
            if shared_runtime {
                "-".to_owned()
            } else {
                format!("{:.1} ({:.0}%)", cpu * 1e6 / n, 100.0 * cpu / share)
            }
        };
        let wall = r.wall.as_secs_f64();
        // Redis's CPU, and requests per EVALSHA call: at moderate rates a call carries fewer
        // requests, so Redis's cost per request, and how busy it is, rise as the rate falls.
        let redis = if r.cpu.redis > 0.0 {
            let calls = if r.cpu.evalsha >= 1.0 {
                format!("{:.1}", n / r.cpu.evalsha)
            } else {
                "n/a".to_owned()
            };
            format!("{} {calls}", cpu_cell(r.cpu.redis, wall))
        } else {
            "-".to_owned()
        };
        let lag = if r.lag_us.is_empty() {
            "-".to_owned()
        } else {
            format!("{:.3}", Phase::percentile(&r.lag_us, 0.99))
        };
        println!(
            "| {:<30} | {:<10} | {:>9.0} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7.3} | {:>7} | {:>9} | {:>6} | {:>5} | {:>6} | {:>14} | {:>14} | {:>22} |",
            row.phase,
            row.server,
            r.rate(),
            Phase::percentile(l, 0.50),
            Phase::percentile(l, 0.99),
            Phase::percentile(l, 0.999),
            Phase::percentile(l, 1.0),
            lag,
            r.counts.ok,
            r.counts.over_limit,
            r.counts.wrong,
            r.counts.errors,
            cpu_cell(r.cpu.server, wall),
            cpu_cell(r.cpu.client, wall),
            redis,
        );
        if shared_runtime {
            println!("|   process CPU {:.1} µs/req", r.cpu.total * 1e6 / n);
        }
    }
    for row in rows {
        let c = &row.result.counts;
        if c.errors > 0 || c.wrong > 0 || c.over_limit > 0 {
            println!(
                "!!!!!! {} / {}: {} errors, {} wrong answers, {} OVER_LIMIT (expected none): {}",
                row.phase,
                row.server,
                c.errors,
                c.wrong,
                c.over_limit,
                c.first_problem.as_deref().unwrap_or("-")
            );
        }
    }
}

/// Servers whose throughput is compared with the Redis ceiling rather than the baseline.
/// The medians of a peak phase's rounds on `shape`, one per server (named in `names`), with a
/// table row and a summary line each.
pub(crate) fn peak_results(
    (phase, shape, names): (&str, Shape, &[&'static str]),
    rounds: &[Vec<Phase>],
    ceiling: (&str, &[Ceiling]),
    opts: &Opts,
    (summary, rows): (&mut Vec<String>, &mut Vec<Row>),
) -> Vec<Phase> {
    let medians: Vec<Phase> = rounds.iter().map(|r| median(r)).collect();
    let baseline = names.iter().position(|server| *server == "baseline");
    for (v, server) in names.iter().enumerate() {
        let reference = reference_rates(server, ceiling, baseline.map(|b| rounds[b].as_slice()));
        if let Some((against, reference)) = reference {
            summary.push(summary_line(
                (phase, server, shape),
                &rounds[v],
                (against, &reference),
                baseline.map(|b| per_request(&medians[b], medians[b].cpu.server)),
            ));
        }
        rows.push(Row {
            phase: format!(
                "{phase}, {}, {}x{}",
                shape.label(),
                opts.connections,
                opts.inflight
            ),
            server,
            result: medians[v].clone(),
        });
    }
    if let Some(floor) = names.iter().position(|server| *server == "floor") {
        for (v, server) in names.iter().enumerate() {
            if !uses_redis(server) && !matches!(*server, "baseline" | "floor") {
                summary.push(floor_line(
                    (phase, server, shape),
                    &rounds[v],
                    &rounds[floor],
                ));
            }
        }
    }
    medians
}

/// The distance to the floor (the do-nothing handler on rlsd's own stack): `server`'s CPU per
/// request over the floor's, round by round (both ran seconds apart), the median and the range.
pub(crate) fn floor_line(
    (phase, server, shape): (&str, &str, Shape),
    rounds: &[Phase],
    floor: &[Phase],
) -> String {
    let cpu = |phase: &Phase| per_request(phase, phase.cpu.server);
    let middle = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        (
            values[values.len() / 2],
            values[0],
            values[values.len() - 1],
        )
    };
    let ratios = rounds
        .iter()
        .zip(floor)
        .map(|(round, floor)| cpu(round) / cpu(floor))
        .collect();
    let (ratio, low, high) = middle(ratios);
    let (own, own_low, own_high) = middle(rounds.iter().map(cpu).collect());
    let (base, base_low, base_high) = middle(floor.iter().map(cpu).collect());
    format!(
        "{server:<10} {:<15} {phase:<6} server CPU {own:.1} µs/req ({own_low:.1}-{own_high:.1}) = {ratio:.2}x the floor's {base:.1} µs/req ({base_low:.1}-{base_high:.1}) (rounds {low:.2}-{high:.2}x)",
        shape.label(),
    )
}

/// What `server`'s req/s is a ratio of, round by round: the Redis ceiling (`ceiling`, named)
/// for the Redis store, the baseline's rounds for the in-process store, nothing for the
/// baseline itself.
pub(crate) fn reference_rates<'a>(
    server: &str,
    (ceiling_name, ceiling): (&'a str, &[Ceiling]),
    baseline: Option<&[Phase]>,
) -> Option<(&'a str, Vec<f64>)> {
    if uses_redis(server) {
        (!ceiling.is_empty()).then(|| {
            (
                ceiling_name,
                ceiling.iter().map(|c| c.calls_per_second).collect(),
            )
        })
    } else if server != "baseline" {
        baseline.map(|rounds| ("baseline", rounds.iter().map(Phase::rate).collect()))
    } else {
        None
    }
}

/// One summary line for `server` on `shape` in `phase`: its median req/s over the rounds, and
/// its ratio to the reference (`against`, whose req/s in each round is given), taken round by
/// round so both sides of a ratio ran within seconds of each other (the machine drifts more
/// than that between rounds): the median ratio and the range. Then the median round's server
/// CPU per request, and Redis's (or what rlsd adds to the baseline's).
pub(crate) fn summary_line(
    (phase, server, shape): (&str, &str, Shape),
    rounds: &[Phase],
    (against, reference): (&str, &[f64]),
    baseline_cpu: Option<f64>,
) -> String {
    let middle = median(rounds);
    let mut ratios: Vec<f64> = rounds
        .iter()
        .zip(reference)
        .map(|(round, reference)| round.rate() / reference)
        .collect();
    ratios.sort_by(f64::total_cmp);
    let cpu = per_request(&middle, middle.cpu.server);
    let mut reference = reference.to_vec();
    reference.sort_by(f64::total_cmp);
    format!(
        "{server:<10} {:<15} {phase:<6} {:>8.0} req/s = {:.2}x {against} (rounds {:.2}-{:.2}x; its median {:.0}/s); server CPU {cpu:.1} µs/req{}",
        shape.label(),
        middle.rate(),
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
        reference[reference.len() / 2],
        match (uses_redis(server), baseline_cpu) {
            (true, _) => format!(
                ", Redis CPU {:.1} µs/req, {}",
                per_request(&middle, middle.cpu.redis),
                if middle.cpu.evalsha >= 1.0 {
                    format!(
                        "{:.1} req/call",
                        middle.latencies_us.len() as f64 / middle.cpu.evalsha
                    )
                } else {
                    "req/call n/a".to_owned()
                }
            ),
            // What carries over: the CPU rlsd adds to a server that does nothing.
            (false, Some(base)) => format!(" (+{:.1} µs over the baseline's)", cpu - base),
            (false, None) => String::new(),
        }
    )
}

/// `cpu` seconds over the phase, in µs per answered request.
pub(crate) fn per_request(phase: &Phase, cpu: f64) -> f64 {
    cpu * 1e6 / phase.latencies_us.len().max(1) as f64
}
