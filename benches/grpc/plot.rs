//! The SVG plot of peak req/s by shape and open-loop latency.

use std::fmt::Write as _;

use rlsd::svg::{self, Frame, MUTED, SERIES, Swatch, escape, nice_ceiling, value_grid};
use rlsd_testkit::workload::Shape;

use crate::Plotted;
use crate::ceiling::Ceiling;
use crate::opts::{Driver, Opts};

/// A plot series: its legend and one value per shape.
pub(crate) type Series = (String, Vec<f64>);

/// About how wide a character of a 12 px label is.
const LABEL_CHAR_WIDTH: f64 = 6.4;

/// p50, p99 and p999 bars, light to dark.
const PERCENTILE_COLOURS: [&str; 3] = ["#9fc3e7", "#3866c4", "#1b2f66"];

/// Hand-written SVG: peak req/s per shape for every server and the Redis ceiling, one panel per
/// client that measured it; latency at the first open-loop fraction of each server's own peak.
pub(crate) fn plot(
    opts: &Opts,
    (shapes, open_shape): (&[Shape], usize),
    ceilings: &[Vec<Option<Ceiling>>],
    plotted: &[Plotted],
) -> String {
    let (width, left, top, panel_h) = (900.0, 70.0, 84.0, 260.0);
    let plot_w = width - left - 30.0;
    let panels: Vec<(Driver, Vec<Series>)> = Driver::ALL
        .into_iter()
        .enumerate()
        .filter(|(d, _)| plotted.iter().any(|p| p.peaks[*d].iter().any(|r| *r > 0.0)))
        .map(|(d, driver)| {
            let mut series: Vec<(String, Vec<f64>)> = plotted
                .iter()
                .map(|p| (p.server.to_owned(), p.peaks[d].clone()))
                .collect();
            let ceiling: Vec<f64> = ceilings[d]
                .iter()
                .map(|c| c.map_or(0.0, |c| c.calls_per_second))
                .collect();
            if ceiling.iter().any(|c| *c > 0.0) {
                series.push(("redis-benchmark (1 EVALSHA/req)".to_owned(), ceiling));
            }
            (driver, series)
        })
        .collect();
    let panel_step = panel_h + 110.0;
    let latency_top = top + panel_step * panels.len() as f64;
    let height = latency_top + panel_h + 70.0;
    let title = format!(
        "rlsd over gRPC: peak throughput ({}x{} in flight, {} limits)",
        opts.connections, opts.inflight, opts.algorithm
    );
    let mut svg = String::new();
    svg::open(&mut svg, width, height, 12, &title);
    let _ = write!(
        svg,
        r#"<text x="{left}" y="24" font-size="16" font-weight="bold">{}</text>
<text x="{left}" y="42" fill="{MUTED}">cargo bench --bench grpc; median of {} round(s); redis = Redis store, coalesced; redis-1 = one EVALSHA per request; all share 2 cores</text>
"#,
        escape(&title),
        opts.rounds
    );
    for (p, (driver, series)) in panels.iter().enumerate() {
        let panel_top = top + panel_step * p as f64;
        let _ = writeln!(
            svg,
            r#"<text x="{left}" y="{:.1}" font-size="14" font-weight="bold">{}</text>"#,
            panel_top - 6.0,
            driver.title()
        );
        let frame = Frame {
            left,
            top: panel_top,
            width: plot_w,
            height: panel_h,
        };
        bar_panel(&mut svg, frame, shapes, series);
    }

    let _ = writeln!(
        svg,
        r#"<text x="{left}" y="{:.1}" font-size="16" font-weight="bold">Latency at {:.0}% of each server's own peak with that client, {}, open loop</text>"#,
        latency_top - 20.0,
        100.0 * opts.open_fractions.first().copied().unwrap_or(0.5),
        shapes[open_shape].label()
    );
    let measured: Vec<(String, [f64; 3])> = Driver::ALL
        .into_iter()
        .enumerate()
        .flat_map(|(d, driver)| {
            plotted.iter().filter_map(move |p| {
                let name = match driver {
                    Driver::Raw => format!("{} (lean)", p.server),
                    _ => format!("{} (tonic)", p.server),
                };
                p.open[d].map(|o| (name, o))
            })
        })
        .collect();
    let max_ms = measured
        .iter()
        .flat_map(|(_, o)| o.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.1, f64::max);
    let scale = nice_ceiling(max_ms);
    let frame = Frame {
        left,
        top: latency_top,
        width: plot_w,
        height: panel_h,
    };
    value_grid(&mut svg, frame, scale, "ms");
    if !measured.is_empty() {
        let group_w = plot_w / measured.len() as f64;
        let bar_w = group_w * 0.8 / 3.0;
        for (g, (server, percentiles)) in measured.iter().enumerate() {
            let x0 = left + group_w * g as f64 + group_w * 0.1;
            for (k, ms) in percentiles.iter().enumerate() {
                let h = frame.bar_height(*ms, scale);
                let x = x0 + bar_w * k as f64;
                let _ = writeln!(
                    svg,
                    r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{ms:.2}</text>"#,
                    frame.bottom() - h,
                    bar_w * 0.9,
                    PERCENTILE_COLOURS[k],
                    x + bar_w * 0.45,
                    frame.bottom() - h - 3.0,
                );
            }
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                left + group_w * (g as f64 + 0.5),
                frame.bottom() + 18.0,
                escape(server)
            );
        }
    }
    let percentiles: Vec<(Swatch, String)> = ["p50", "p99", "p999"]
        .into_iter()
        .zip(PERCENTILE_COLOURS)
        .map(|(name, colour)| (Swatch::Box(colour), name.to_owned()))
        .collect();
    svg::legend(
        &mut svg,
        left,
        frame.bottom() + 40.0,
        LABEL_CHAR_WIDTH,
        &percentiles,
    );
    svg.push_str("</svg>\n");
    svg
}

/// Bars of req/s per shape, one per series, with the grid and legend, in `frame`.
fn bar_panel(svg: &mut String, frame: Frame, shapes: &[Shape], series: &[Series]) {
    let max_rate = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(1.0, f64::max);
    let scale = nice_ceiling(max_rate);
    value_grid(svg, frame, scale, "req/s");
    let group_w = frame.width / shapes.len() as f64;
    let bar_w = (group_w * 0.8) / series.len() as f64;
    for (s, shape) in shapes.iter().enumerate() {
        let x0 = frame.left + group_w * s as f64 + group_w * 0.1;
        for (k, (_, values)) in series.iter().enumerate() {
            let h = frame.bar_height(values[s], scale);
            let x = x0 + bar_w * k as f64;
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"><title>{:.0}</title></rect>"#,
                frame.bottom() - h,
                bar_w * 0.9,
                SERIES[k % SERIES.len()],
                values[s]
            );
            if values[s] > 0.0 {
                let _ = writeln!(
                    svg,
                    r#"<text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{:.1}k</text>"#,
                    x + bar_w * 0.45,
                    frame.bottom() - h - 3.0,
                    values[s] / 1000.0
                );
            }
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            frame.left + group_w * (s as f64 + 0.5),
            frame.bottom() + 18.0,
            shape.label()
        );
    }
    let entries: Vec<(Swatch, String)> = series
        .iter()
        .enumerate()
        .map(|(k, (name, _))| (Swatch::Box(SERIES[k % SERIES.len()]), name.clone()))
        .collect();
    svg::legend(
        svg,
        frame.left,
        frame.bottom() + 40.0,
        LABEL_CHAR_WIDTH,
        &entries,
    );
}
