#include "megatorch/pipeline/timeline_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/io/atomic_file.h"

namespace megatorch::pipeline {

namespace {

constexpr double kLeft = 70, kRight = 20, kGap = 4, kFont = 11;

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Hex colour from hue (degrees), saturation and lightness (0..1): SVG 1.1 viewers do not
// all read hsl().
std::string hsl(double h, double s, double l) {
  auto channel = [&](double n) {
    const double k = std::fmod(n + h / 30.0, 12.0);
    const double a = s * std::min(l, 1 - l);
    return static_cast<int>(std::lround(255 * (l - a * std::max(-1.0, std::min({k - 3, 9 - k, 1.0})))));
  };
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", channel(0), channel(8), channel(4));
  return buf;
}

// Lightness of chunk c of n: chunk 0 lightest, the last darkest, so chunks read apart.
double shade(int64_t c, int64_t n) {
  return n <= 1 ? 0.58 : 0.80 - 0.42 * static_cast<double>(c) / static_cast<double>(n - 1);
}

struct Style {
  std::string fill;
  bool dark;  // white label
};

Style style_of(ActionKind kind, int64_t chunk, int64_t chunks) {
  const double l = shade(chunk, chunks);
  const bool dark = l < 0.6;
  switch (kind) {
    case ActionKind::kForward: return {hsl(212, 0.62, l), dark};
    case ActionKind::kBackwardWeight: return {hsl(135, 0.45, l), dark};
    default: return {hsl(28, 0.85, l), dark};  // backward, backward_input
  }
}

const char* short_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward: return "forward";
    case ActionKind::kBackwardInput: return "backward (input)";
    case ActionKind::kBackwardWeight: return "backward (weight)";
    default: return "backward";
  }
}

std::string num(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// 1, 2 or 5 times a power of ten, giving about `target` ticks over `span`.
double tick_step(double span, int target) {
  const double raw = span / target;
  const double base = std::pow(10.0, std::floor(std::log10(raw)));
  for (double f : {1.0, 2.0, 5.0})
    if (f * base >= raw) return f * base;
  return 10 * base;
}

}  // namespace

std::string timeline_svg(const std::vector<TimelineRecord>& records, const TimelineSvgOptions& options) {
  MEGATORCH_CHECK(options.plot_width > 0 && options.lane_height > 0,
                  "expected a positive plot_width and lane_height, got ", options.plot_width, " and ",
                  options.lane_height);
  int64_t ranks = options.num_ranks, chunks = options.num_chunks;
  double t0 = 0, t1 = 0;
  bool first = true;
  bool kinds[4] = {false, false, false, false};  // forward, backward, input, weight: legend rows
  for (const auto& rec : records) {
    MEGATORCH_CHECK(rec.rank >= 0 && rec.action.chunk >= 0 && rec.end >= rec.start,
                    "expected timeline records with rank >= 0, chunk >= 0 and end >= start, got rank ", rec.rank,
                    " ", to_string(rec.action), " [", rec.start, ", ", rec.end, "]");
    if (!is_compute(rec.action.kind)) continue;
    ranks = std::max(ranks, rec.rank + 1);
    chunks = std::max(chunks, rec.action.chunk + 1);
    t0 = first ? rec.start : std::min(t0, rec.start);
    t1 = first ? rec.end : std::max(t1, rec.end);
    first = false;
    kinds[static_cast<int>(rec.action.kind)] = true;
  }
  chunks = std::max<int64_t>(chunks, 1);
  const double span = t1 > t0 ? t1 - t0 : 1;
  const double scale = options.plot_width / span, lane = options.lane_height;
  const double top = options.title.empty() ? 12 : 36;
  const double axis = top + static_cast<double>(ranks) * (lane + kGap) + 2;
  const double width = kLeft + options.plot_width + kRight;

  std::ostringstream body;
  // Lanes: a grey band per rank, so idle time shows as grey.
  for (int64_t r = 0; r < ranks; ++r) {
    const double y = top + static_cast<double>(r) * (lane + kGap);
    body << "<rect x=\"" << kLeft << "\" y=\"" << y << "\" width=\"" << options.plot_width << "\" height=\"" << lane
         << "\" fill=\"#eeeeee\"/>\n<text x=\"" << kLeft - 8 << "\" y=\"" << y + lane / 2 + kFont * 0.35
         << "\" text-anchor=\"end\">rank " << r << "</text>\n";
  }
  for (const auto& rec : records) {
    if (!is_compute(rec.action.kind)) continue;
    const Action& a = rec.action;
    const Style st = style_of(a.kind, a.chunk, chunks);
    const double x = kLeft + (rec.start - t0) * scale, w = (rec.end - rec.start) * scale;
    const double y = top + static_cast<double>(rec.rank) * (lane + kGap);
    // A white edge separates neighbouring boxes; thin boxes go without, or it washes them out.
    const char* edge = w >= 4 ? "\" stroke=\"#ffffff\" stroke-width=\"0.6" : "";
    body << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << lane << "\" fill=\""
         << st.fill << edge << "\"><title>rank " << rec.rank << " " << action_kind_name(a.kind) << " micro-batch "
         << a.microbatch << " chunk " << a.chunk << " [" << num(rec.start) << ", " << num(rec.end)
         << "]</title></rect>\n";
    const std::string label = std::to_string(a.microbatch);
    if (w >= static_cast<double>(label.size()) * kFont * 0.62 + 2)
      body << "<text x=\"" << x + w / 2 << "\" y=\"" << y + lane / 2 + kFont * 0.35
           << "\" text-anchor=\"middle\" fill=\"" << (st.dark ? "#ffffff" : "#111111") << "\">" << label
           << "</text>\n";
  }
  // Time axis with 1-2-5 ticks.
  body << "<line x1=\"" << kLeft << "\" y1=\"" << axis << "\" x2=\"" << kLeft + options.plot_width << "\" y2=\""
       << axis << "\" stroke=\"#444444\"/>\n";
  const double step = tick_step(span, 10);
  for (double t = std::ceil(t0 / step) * step; t <= t1 + step * 1e-9; t += step) {
    const double x = kLeft + (t - t0) * scale;
    body << "<line x1=\"" << x << "\" y1=\"" << axis << "\" x2=\"" << x << "\" y2=\"" << axis + 4
         << "\" stroke=\"#444444\"/><text x=\"" << x << "\" y=\"" << axis + 16 << "\" text-anchor=\"middle\">"
         << num(std::abs(t) < step * 1e-9 ? 0 : t) << "</text>\n";
  }
  if (!options.time_unit.empty())
    body << "<text x=\"" << kLeft + options.plot_width << "\" y=\"" << axis + 30 << "\" text-anchor=\"end\">time ("
         << escape(options.time_unit) << ")</text>\n";
  // Legend: one row per kind present, one swatch per chunk.
  double y = axis + 40;
  for (int k = 0; k < 4; ++k) {
    if (!kinds[k]) continue;
    const auto kind = static_cast<ActionKind>(k);
    body << "<text x=\"" << kLeft - 8 << "\" y=\"" << y + 10 << "\" text-anchor=\"end\">" << short_name(kind)
         << "</text>\n";
    for (int64_t c = 0; c < chunks; ++c) {
      const double x = kLeft + static_cast<double>(c) * 80;
      body << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"14\" height=\"14\" fill=\""
           << style_of(kind, c, chunks).fill << "\"/>";
      if (chunks > 1) body << "<text x=\"" << x + 18 << "\" y=\"" << y + 11 << "\">chunk " << c << "</text>";
      body << "\n";
    }
    y += 20;
  }
  body << "<text x=\"" << kLeft << "\" y=\"" << y + 10 << "\" fill=\"#555555\">number in a box: micro-batch; "
       << "grey: idle</text>\n";
  const double height = y + 22;

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << " " << height << "\" font-family=\"sans-serif\" font-size=\"" << kFont
      << "\">\n<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  if (!options.title.empty())
    svg << "<text x=\"" << kLeft << "\" y=\"22\" font-size=\"14\" font-weight=\"bold\">" << escape(options.title)
        << "</text>\n";
  svg << body.str() << "</svg>\n";
  return svg.str();
}

void write_timeline_svg(const std::string& path, const std::vector<TimelineRecord>& records,
                        const TimelineSvgOptions& options) {
  const std::string svg = timeline_svg(records, options);
  // Atomic: a viewer (or a rerun's reader) never sees half an SVG; errors name the file.
  io::write_file_atomically(path, svg);
}

}  // namespace megatorch::pipeline
