#pragma once
// Draws a pipeline timeline as SVG from plain timing records, so that simulated ticks
// and measured seconds from the executor go through the same drawing. One lane per
// rank, one box per compute action numbered with its micro-batch; forwards in blues,
// backwards in oranges (split backwards: input orange, weight green), a darker shade per
// model chunk, with a legend. Transfers are not drawn: the gaps between boxes are the
// bubble. Every box has a <title> tooltip with its exact times.
#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/pipeline/schedule.h"

namespace megatorch::pipeline {

struct TimelineRecord {
  int64_t rank = 0;
  Action action;
  double start = 0;
  double end = 0;
};

struct TimelineSvgOptions {
  std::string title;          // drawn above the lanes; empty for none
  std::string time_unit;      // axis label suffix, e.g. "ticks" or "ms"
  double plot_width = 1200;   // pixels for the time axis
  double lane_height = 26;    // pixels per rank
  int64_t num_ranks = 0;      // lanes: at least this many, and one per rank in the records
  int64_t num_chunks = 0;     // chunk shades: at least this many, and one per chunk in the records
};

// The SVG document (UTF-8 text). Records may come in any order; non-compute ones are
// skipped. Throws on a record with end < start or a negative rank or chunk.
std::string timeline_svg(const std::vector<TimelineRecord>& records, const TimelineSvgOptions& options = {});

// Writes timeline_svg(...) to `path`; throws naming the path when it cannot be written.
void write_timeline_svg(const std::string& path, const std::vector<TimelineRecord>& records,
                        const TimelineSvgOptions& options = {});

}  // namespace megatorch::pipeline
