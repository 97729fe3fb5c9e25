//! The picture: one panel per algorithm, stacked, as hand-written SVG.
//!
//! Each panel has the admitted-rate curve on top (requests admitted in the trailing window of
//! the limit's period, against the limit L) and per-bucket bars below (allowed up, denied down).
//! Every panel shares the same scales, so panels compare at a glance.

use std::fmt::Write;

use super::traffic::format_duration;
use super::{Report, Run, stats};
use crate::svg::{self, BLUE, GREEN, GRID, INK, MUTED, RED, Swatch, escape};

const WIDTH: f64 = 960.0;
const LEFT: f64 = 72.0;
const RIGHT: f64 = 28.0;
const PLOT_W: f64 = WIDTH - LEFT - RIGHT;
/// One curve value per pixel column of the plot.
const COLUMNS: usize = PLOT_W as usize;
const HEADER: f64 = 104.0;
const PANEL: f64 = 222.0;
const FOOTER: f64 = 30.0;
// Offsets inside a panel.
const CURVE_TOP: f64 = 26.0;
const CURVE_H: f64 = 100.0;
const BARS_MID: f64 = 164.0;
const BAR_H: f64 = 30.0;
const TICK_LABELS: f64 = 208.0;

const BOUNDARY: &str = "#a8a8a8";

/// Aim for about this many bars and tick labels across the plot.
const BARS: u64 = 120;
const TICKS: u64 = 8;
/// Window boundaries are drawn only while they stay readable.
const MAX_BOUNDARIES: u64 = 60;

/// Round time steps, in microseconds, for ticks and bars.
const STEPS_US: [u64; 30] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    15_000_000,
    30_000_000,
    60_000_000,
    120_000_000,
    300_000_000,
    600_000_000,
    900_000_000,
    1_800_000_000,
    3_600_000_000,
    7_200_000_000,
    10_800_000_000,
    21_600_000_000,
    43_200_000_000,
    86_400_000_000,
    172_800_000_000,
    604_800_000_000,
    2_592_000_000_000,
];

/// Renders the report as a standalone SVG document.
pub fn render(report: &Report) -> String {
    let scales = Scales::of(report);
    let height = HEADER + PANEL * report.runs.len() as f64 + FOOTER;
    let mut out = String::with_capacity(64 * 1024);
    svg::open(&mut out, WIDTH, height, 11, &report.title());
    header(&mut out, report, &scales);
    for (index, run) in report.runs.iter().enumerate() {
        panel(
            &mut out,
            report,
            run,
            &scales,
            HEADER + PANEL * index as f64,
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="{MUTED}">time since the start of the simulation (window boundaries of the limit's period are aligned to it)</text>"#,
        LEFT + PLOT_W / 2.0,
        height - 10.0
    );
    out.push_str("</svg>\n");
    out
}

/// Scales shared by every panel.
struct Scales {
    duration_us: u64,
    window_us: u64,
    limit: u64,
    curve_max: f64,
    bucket_us: u64,
    bar_max: u64,
    tick_us: u64,
}

impl Scales {
    fn of(report: &Report) -> Scales {
        let duration_us = report.duration_us.max(1);
        let limit = u64::from(report.limit().requests_per_unit);
        let peak = report
            .runs
            .iter()
            .map(|run| run.summary.max_in_window as u64)
            .max()
            .unwrap_or(0);
        let bucket_us = nice_step(duration_us / BARS);
        let bar_max = report
            .runs
            .iter()
            .flat_map(|run| {
                let (allowed, denied) = buckets(report, run, bucket_us);
                allowed.into_iter().chain(denied)
            })
            .max()
            .unwrap_or(0);
        Scales {
            duration_us,
            window_us: report.window_us(),
            limit,
            // Headroom above the highest of L and the peak, for the labels.
            curve_max: peak.max(limit).max(1) as f64 * 1.18,
            bucket_us,
            bar_max: bar_max.max(1),
            tick_us: nice_step(duration_us / TICKS),
        }
    }

    fn x(&self, t: u64) -> f64 {
        LEFT + t as f64 / self.duration_us as f64 * PLOT_W
    }

    fn y(&self, count: f64) -> f64 {
        CURVE_TOP + CURVE_H - count / self.curve_max * CURVE_H
    }

    fn bar(&self, count: u64) -> f64 {
        match count {
            0 => 0.0,
            // Keep a single request visible.
            n => (n as f64 / self.bar_max as f64 * BAR_H).max(2.0),
        }
    }
}

/// The smallest round step at least `at_least_us` long.
fn nice_step(at_least_us: u64) -> u64 {
    STEPS_US
        .into_iter()
        .find(|&step| step >= at_least_us)
        .unwrap_or(STEPS_US[STEPS_US.len() - 1])
}

/// Allowed and denied requests per bucket.
fn buckets(report: &Report, run: &Run, bucket_us: u64) -> (Vec<u64>, Vec<u64>) {
    let pick = |allowed: bool| {
        report
            .times_us
            .iter()
            .zip(&run.answers)
            .filter(move |(_, answer)| answer.allowed == allowed)
            .map(|(&t, _)| t)
    };
    (
        stats::per_bucket(pick(true), bucket_us, report.duration_us),
        stats::per_bucket(pick(false), bucket_us, report.duration_us),
    )
}

fn header(out: &mut String, report: &Report, scales: &Scales) {
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="26" font-size="17" font-weight="bold" fill="{INK}">{}</text>"#,
        escape(&report.title())
    );
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="46" font-size="12" fill="{INK}">limit: {}</text>"#,
        escape(&report.limit().to_string())
    );
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="64" font-size="12" fill="{INK}">traffic: {} ({} requests in {}, simulated clock; every panel replays the same requests)</text>"#,
        escape(&report.traffic_label),
        report.times_us.len(),
        format_duration(report.duration_us)
    );
    let mut entries = vec![
        (
            Swatch::Area(BLUE),
            format!(
                "admitted in the trailing {}",
                format_duration(scales.window_us)
            ),
        ),
        (Swatch::Dashed(INK), format!("limit L = {}", scales.limit)),
        (
            Swatch::Box(GREEN),
            format!("allowed per {} (up)", format_duration(scales.bucket_us)),
        ),
        (
            Swatch::Box(RED),
            format!("denied per {} (down)", format_duration(scales.bucket_us)),
        ),
    ];
    if boundaries_drawn(scales) {
        entries.push((Swatch::Boundary(BOUNDARY), "window boundary".to_owned()));
    }
    // Labels at 11 px.
    svg::legend(out, LEFT, 86.0, 5.8, &entries);
}

fn boundaries_drawn(scales: &Scales) -> bool {
    scales.window_us < scales.duration_us
        && scales.duration_us / scales.window_us.max(1) <= MAX_BOUNDARIES
}

fn panel(out: &mut String, report: &Report, run: &Run, scales: &Scales, top: f64) {
    let _ = writeln!(out, r#"<g transform="translate(0 {top})">"#);
    let summary = &run.summary;
    let mut name = run.algorithm.name().to_owned();
    if let Some(limit) = run.limits.first()
        && run.algorithm.takes_burst()
    {
        let _ = write!(name, " (burst {})", limit.effective_burst());
    }
    if run.algorithm == report.limit().algorithm {
        name.push_str(" - configured");
    }
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="16" font-size="13" font-weight="bold" fill="{INK}">{}</text>"#,
        escape(&name)
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="16" text-anchor="end" fill="{INK}">allowed {} / denied {} / max {} in any {} ({}) / longest retry-after {}</text>"#,
        LEFT + PLOT_W,
        summary.allowed,
        summary.denied,
        summary.max_in_window,
        format_duration(scales.window_us),
        escape(&super::times_limit(
            summary.max_in_window,
            report.limit().requests_per_unit
        )),
        escape(&super::format_wait(summary.longest_retry_after_us))
    );

    // Frame and time grid.
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{CURVE_TOP}" width="{PLOT_W}" height="{CURVE_H}" fill="#fbfbfb" stroke="#cccccc"/>"##
    );
    let mut tick = 0;
    while tick <= scales.duration_us {
        let x = scales.x(tick);
        let _ = writeln!(
            out,
            r#"<line x1="{x:.1}" y1="{CURVE_TOP}" x2="{x:.1}" y2="{:.1}" stroke="{GRID}"/>"#,
            CURVE_TOP + CURVE_H
        );
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{TICK_LABELS}" text-anchor="middle" fill="{MUTED}">{}</text>"#,
            tick_label(tick, scales.tick_us)
        );
        tick += scales.tick_us;
    }
    if boundaries_drawn(scales) {
        let mut boundary = scales.window_us;
        while boundary < scales.duration_us {
            let x = scales.x(boundary);
            let _ = writeln!(
                out,
                r#"<line x1="{x:.1}" y1="{CURVE_TOP}" x2="{x:.1}" y2="{:.1}" stroke="{BOUNDARY}" stroke-dasharray="2 2"/>"#,
                BARS_MID + BAR_H
            );
            boundary += scales.window_us.max(1);
        }
    }

    // Admitted in the trailing window, as a filled step curve at one value per pixel column.
    let allowed: Vec<u64> = report
        .times_us
        .iter()
        .zip(&run.answers)
        .filter(|(_, answer)| answer.allowed)
        .map(|(&t, _)| t)
        .collect();
    let curve =
        stats::trailing_max_per_column(&allowed, scales.window_us, scales.duration_us, COLUMNS);
    let base = scales.y(0.0);
    let column_x = |c: usize| LEFT + c as f64 * PLOT_W / COLUMNS as f64;
    let mut path = format!("M{LEFT:.1} {base:.1}");
    let mut last = None;
    for (c, &value) in curve.iter().enumerate() {
        if last != Some(value) {
            let _ = write!(path, "H{:.1}V{:.1}", column_x(c), scales.y(value as f64));
            last = Some(value);
        }
    }
    let _ = write!(path, "H{:.1}V{base:.1}Z", LEFT + PLOT_W);
    let _ = writeln!(
        out,
        r#"<path d="{path}" fill="{BLUE}" fill-opacity="0.18" stroke="{BLUE}" stroke-width="1.3" stroke-linejoin="round"/>"#
    );

    // The limit, twice the limit when it is in view, and the y axis labels.
    let mut guides = vec![(scales.limit, format!("L = {}", scales.limit), "4 3", INK)];
    if scales.limit > 0 {
        let double = 2 * scales.limit;
        guides.push((double, format!("2L = {double}"), "1 3", MUTED));
    }
    for (value, label, dash, colour) in guides {
        let value = value as f64;
        if value > scales.curve_max {
            continue;
        }
        let y = scales.y(value);
        let _ = writeln!(
            out,
            r#"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{colour}" stroke-dasharray="{dash}"/>"#,
            LEFT + PLOT_W
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="{colour}">{}</text>"#,
            LEFT - 6.0,
            y + 4.0,
            escape(&label)
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="{MUTED}">0</text>"#,
        LEFT - 6.0,
        base + 4.0
    );

    // Mark the peak, where an algorithm admits the most in one window.
    if let Some((column, &peak)) = curve
        .iter()
        .enumerate()
        .max_by_key(|&(c, &v)| (v, std::cmp::Reverse(c)))
        && peak > 0
    {
        let x = column_x(column).clamp(LEFT + 30.0, LEFT + PLOT_W - 30.0);
        let colour = if peak as u64 > scales.limit {
            RED
        } else {
            BLUE
        };
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle" font-weight="bold" fill="{colour}">peak {peak}</text>"#,
            scales.y(peak as f64) - 4.0
        );
    }

    // Allowed up, denied down, per bucket.
    let (allowed_per, denied_per) = buckets(report, run, scales.bucket_us);
    let bar_w = (scales.bucket_us as f64 / scales.duration_us as f64 * PLOT_W - 0.4).max(0.6);
    for (index, (&up, &down)) in allowed_per.iter().zip(&denied_per).enumerate() {
        let x = scales.x(index as u64 * scales.bucket_us);
        if up > 0 {
            let h = scales.bar(up);
            let _ = writeln!(
                out,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bar_w:.2}" height="{h:.1}" fill="{GREEN}"/>"#,
                BARS_MID - h
            );
        }
        if down > 0 {
            let _ = writeln!(
                out,
                r#"<rect x="{x:.1}" y="{BARS_MID}" width="{bar_w:.2}" height="{:.1}" fill="{RED}"/>"#,
                scales.bar(down)
            );
        }
    }
    let _ = writeln!(
        out,
        r##"<line x1="{LEFT}" y1="{BARS_MID}" x2="{:.1}" y2="{BARS_MID}" stroke="#999999"/>"##,
        LEFT + PLOT_W
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="{GREEN}">allowed</text>"#,
        LEFT - 6.0,
        BARS_MID - 5.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="{RED}">denied</text>"#,
        LEFT - 6.0,
        BARS_MID + 13.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="{MUTED}" font-size="9">tallest bar: {} requests</text>"#,
        LEFT + PLOT_W,
        BARS_MID + BAR_H - 2.0,
        scales.bar_max
    );
    out.push_str("</g>\n");
}

/// Labels a tick in the unit of the tick step, so labels read `0s 15s 30s` or `0m 1m 2m`.
fn tick_label(t: u64, step_us: u64) -> String {
    const UNITS: [(u64, &str); 5] = [
        (86_400_000_000, "d"),
        (3_600_000_000, "h"),
        (60_000_000, "m"),
        (1_000_000, "s"),
        (1_000, "ms"),
    ];
    let (size, unit) = UNITS
        .into_iter()
        .find(|(size, _)| step_us.is_multiple_of(*size))
        .unwrap_or((1_000, "ms"));
    if t.is_multiple_of(size) {
        format!("{}{unit}", t / size)
    } else {
        format!("{:.1}{unit}", t as f64 / size as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_round() {
        assert_eq!(nice_step(1_000_000), 1_000_000);
        assert_eq!(nice_step(1_000_001), 2_000_000);
        assert_eq!(nice_step(0), 1_000);
        assert_eq!(nice_step(u64::MAX), 2_592_000_000_000);
    }

    #[test]
    fn ticks_read_in_the_step_unit() {
        assert_eq!(tick_label(0, 15_000_000), "0s");
        assert_eq!(tick_label(75_000_000, 15_000_000), "75s");
        assert_eq!(tick_label(120_000_000, 60_000_000), "2m");
        assert_eq!(tick_label(1_500_000, 500_000), "1500ms");
    }
}
