//! A dependency-free SVG line plot of bus bandwidth against message size
//! (log2 x axis), for `kungfu-bench --plot`, or against another quantity
//! on a log2 axis (`kungfu-sim`: workers).

use std::fmt::Write;

use crate::fmt_size;

/// One line of the plot: a label and (size in bytes, GB/s) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(usize, f64)>,
}

const W: f64 = 720.0;
const H: f64 = 420.0;
// margins: left, right, top, bottom
const L: f64 = 70.0;
const R: f64 = 20.0;
const T: f64 = 40.0;
const B: f64 = 50.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders `series` as an SVG document.
pub fn svg(title: &str, series: &[Series]) -> String {
    svg_axes(title, "message size", &fmt_size, series)
}

/// Renders `series` as an SVG document, the x axis named `xlabel` with
/// its ticks written by `tick`.
pub fn svg_axes(
    title: &str,
    xlabel: &str,
    tick: &dyn Fn(usize) -> String,
    series: &[Series],
) -> String {
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| p.0 > 0);
    let (mut xmin, mut xmax, mut ymax) = (f64::MAX, f64::MIN, 0.0f64);
    for &(x, y) in pts {
        let lx = (x as f64).log2();
        xmin = xmin.min(lx);
        xmax = xmax.max(lx);
        ymax = ymax.max(y);
    }
    if xmin > xmax {
        (xmin, xmax) = (0.0, 1.0);
    }
    if xmax - xmin < 1.0 {
        xmax = xmin + 1.0;
    }
    let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
    let px = |x: usize| L + ((x as f64).log2() - xmin) / (xmax - xmin) * (W - L - R);
    let py = |y: f64| H - B - y / ymax * (H - T - B);
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    // axes and grid
    let _ = writeln!(
        o,
        r#"<line x1="{L}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        H - B,
        W - R,
        H - B
    );
    let _ = writeln!(
        o,
        r#"<line x1="{L}" y1="{T}" x2="{L}" y2="{}" stroke="black"/>"#,
        H - B
    );
    let mut e = xmin.ceil() as i64;
    let step = (((xmax - xmin) / 8.0).ceil() as i64).max(1);
    while (e as f64) <= xmax {
        let x = px(1usize << e.clamp(0, 62));
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{T}" x2="{x:.1}" y2="{}" stroke="#ddd"/>"##,
            H - B
        );
        let _ = writeln!(
            o,
            r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
            H - B + 16.0,
            tick(1usize << e.clamp(0, 62))
        );
        e += step;
    }
    for i in 0..=5 {
        let v = ymax * f64::from(i) / 5.0;
        let y = py(v);
        let _ = writeln!(
            o,
            r##"<line x1="{L}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#eee"/>"##,
            W - R
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{v:.2}</text>"#,
            L - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (L + W - R) / 2.0,
        H - 12.0,
        esc(xlabel)
    );
    let _ = writeln!(
        o,
        r#"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">bus bandwidth (GB/s)</text>"#,
        (T + H - B) / 2.0,
        (T + H - B) / 2.0
    );
    for (k, s) in series.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let path: Vec<String> = s
            .points
            .iter()
            .filter(|p| p.0 > 0)
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for p in &path {
            let (x, y) = p.split_once(',').expect("x,y");
            let _ = writeln!(o, r#"<circle cx="{x}" cy="{y}" r="2.5" fill="{c}"/>"#);
        }
        let ly = T + 14.0 + 16.0 * k as f64;
        let _ = writeln!(
            o,
            r#"<rect x="{}" y="{}" width="12" height="3" fill="{c}"/>"#,
            L + 12.0,
            ly - 4.0
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{ly}">{}</text>"#,
            L + 30.0,
            esc(&s.label)
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_points_and_labels() {
        let s = svg(
            "allreduce <np=4>",
            &[Series {
                label: "out-of-place".into(),
                points: vec![(0, 0.0), (1024, 0.5), (1 << 20, 2.0)],
            }],
        );
        assert!(s.starts_with("<svg"));
        assert!(s.contains("allreduce &lt;np=4&gt;"));
        assert_eq!(s.matches("<circle").count(), 2);
        assert!(s.contains(">1K<") && s.contains(">1M<"));
    }
}
