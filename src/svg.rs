//! Hand-written SVG, shared by `rlsd simulate`'s picture and the bench tool's plots: text
//! escaping, one palette, round scales, a value grid and legends.

use std::fmt::Write;

/// Text and frames.
pub const INK: &str = "#222";
/// Axis labels and notes.
pub const MUTED: &str = "#666";
/// Grid lines.
pub const GRID: &str = "#e6e6e6";
/// Allowed, and good.
pub const GREEN: &str = "#2e9d4a";
/// Denied, and over a limit.
pub const RED: &str = "#d64541";
/// The main series.
pub const BLUE: &str = "#3866c4";
/// One colour per series, in order, for plots of several (cycled beyond seven).
pub const SERIES: [&str; 7] = ["#9a9a9a", BLUE, RED, "#e8923a", GREEN, "#8e5bb5", "#444444"];

/// A standalone document's opening: the root element with its size, a white background and
/// a `<title>`; close it with `</svg>`.
pub fn open(out: &mut String, width: f64, height: f64, font_size: u32, title: &str) {
    let _ = writeln!(out, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="{font_size}">"#
    );
    let _ = writeln!(out, "<title>{}</title>", escape(title));
    let _ = writeln!(
        out,
        r##"<rect width="{width}" height="{height}" fill="#ffffff"/>"##
    );
}

/// The smallest 1, 2 or 5 times a power of ten at or above `value`: an axis's top.
pub fn nice_ceiling(value: f64) -> f64 {
    let power = 10f64.powf(value.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|v| *v >= value)
        .unwrap_or(10.0 * power)
}

/// Where a plot's area is: left and top edges, width and height.
#[derive(Clone, Copy, Debug)]
pub struct Frame {
    /// Left edge.
    pub left: f64,
    /// Top edge.
    pub top: f64,
    /// Width.
    pub width: f64,
    /// Height.
    pub height: f64,
}

impl Frame {
    /// The bottom edge.
    pub fn bottom(&self) -> f64 {
        self.top + self.height
    }

    /// The height of `value` on a scale from 0 at the bottom to `scale` at the top (clamped).
    pub fn bar_height(&self, value: f64, scale: f64) -> f64 {
        self.height * value.clamp(0.0, scale) / scale
    }
}

/// Six horizontal grid lines from 0 to `scale`, labelled on the left (`1k` from 1000 up), and
/// `unit` written up the left margin.
pub fn value_grid(out: &mut String, frame: Frame, scale: f64, unit: &str) {
    for i in 0..=5 {
        let y = frame.bottom() - frame.height * f64::from(i) / 5.0;
        let value = scale * f64::from(i) / 5.0;
        let label = if value >= 1000.0 {
            format!("{:.0}k", value / 1000.0)
        } else {
            // Rounded: steps like 0.02 are not exact in binary.
            format!("{}", (value * 1000.0).round() / 1000.0)
        };
        let _ = writeln!(
            out,
            r#"<line x1="{}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="{GRID}"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="{MUTED}">{label}</text>"#,
            frame.left,
            frame.left + frame.width,
            frame.left - 6.0,
            y + 4.0
        );
    }
    let middle = frame.top + frame.height / 2.0;
    let _ = writeln!(
        out,
        r#"<text x="14" y="{middle:.1}" fill="{MUTED}" transform="rotate(-90 14 {middle:.1})" text-anchor="middle">{}</text>"#,
        escape(unit)
    );
}

/// How a legend entry is drawn.
#[derive(Clone, Copy, Debug)]
pub enum Swatch {
    /// A filled box.
    Box(&'static str),
    /// A lightly filled, outlined box: an area under a curve.
    Area(&'static str),
    /// A dashed horizontal line: a threshold.
    Dashed(&'static str),
    /// A dotted vertical line: a boundary in time.
    Boundary(&'static str),
}

/// One row of legend entries from `left` on the baseline `y`, each a swatch and its label,
/// spaced for labels whose characters are about `char_width` px wide (half the font size).
pub fn legend(out: &mut String, left: f64, y: f64, char_width: f64, entries: &[(Swatch, String)]) {
    let mut x = left;
    for (swatch, label) in entries {
        let _ = match *swatch {
            Swatch::Box(colour) => writeln!(
                out,
                r#"<rect x="{x:.1}" y="{:.1}" width="14" height="10" fill="{colour}"/>"#,
                y - 9.0
            ),
            Swatch::Area(colour) => writeln!(
                out,
                r#"<rect x="{x:.1}" y="{:.1}" width="14" height="10" fill="{colour}" fill-opacity="0.25" stroke="{colour}"/>"#,
                y - 9.0
            ),
            Swatch::Dashed(colour) => writeln!(
                out,
                r#"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-dasharray="4 3"/>"#,
                y - 4.0,
                x + 14.0,
                y - 4.0
            ),
            Swatch::Boundary(colour) => writeln!(
                out,
                r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-dasharray="2 2"/>"#,
                x + 7.0,
                y - 10.0,
                x + 7.0,
                y + 1.0
            ),
        };
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{y}" fill="{INK}">{}</text>"#,
            x + 20.0,
            escape(label)
        );
        // The label's estimated width, the swatch and a gap.
        x += 34.0 + label.chars().count() as f64 * char_width;
    }
}

/// Escapes text for XML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Control characters are not allowed in XML 1.0 at all.
            c if c.is_control() && !matches!(c, '\t' | '\n' | '\r') => out.push('?'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_makes_text_safe_for_xml() {
        assert_eq!(
            escape(r#"a<b & "c" 'd'>"#),
            "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;"
        );
        assert_eq!(escape("bell\u{7}"), "bell?");
    }

    #[test]
    fn ceilings_are_one_two_or_five_times_a_power_of_ten() {
        assert_eq!(nice_ceiling(1.0), 1.0);
        assert_eq!(nice_ceiling(1.2), 2.0);
        assert_eq!(nice_ceiling(3_100.0), 5_000.0);
        assert_eq!(nice_ceiling(7_000.0), 10_000.0);
        assert_eq!(nice_ceiling(0.03), 0.05);
    }

    #[test]
    fn the_grid_labels_thousands_and_escapes_the_unit() {
        let mut out = String::new();
        let frame = Frame {
            left: 70.0,
            top: 10.0,
            width: 800.0,
            height: 100.0,
        };
        value_grid(&mut out, frame, 50_000.0, "req/s <peak>");
        assert_eq!(out.matches("<line").count(), 6);
        assert!(
            out.contains(">50k</text>") && out.contains(">0</text>"),
            "{out}"
        );
        assert!(out.contains("req/s &lt;peak&gt;"), "{out}");
    }

    #[test]
    fn legend_entries_do_not_overlap() {
        let mut out = String::new();
        let entries = [
            (
                Swatch::Box(RED),
                "a long label of thirty chars..".to_owned(),
            ),
            (Swatch::Dashed(INK), "b".to_owned()),
        ];
        legend(&mut out, 0.0, 20.0, 6.4, &entries);
        let xs: Vec<f64> = out
            .lines()
            .filter(|l| l.starts_with("<text"))
            .filter_map(|l| l.split('"').nth(1)?.parse().ok())
            .collect();
        // The second label starts after the first one's 30 characters at ~6.4 px each.
        assert!(xs[1] - xs[0] > 30.0 * 6.0, "{xs:?}");
    }
}
