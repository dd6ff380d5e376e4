#pragma once
// Action lists written by hand in the schedule tests: F(mb, chunk), SA(mb, chunk, peer), ...
#include <megatorch/pipeline/schedule.h>

namespace schedule_test {

using megatorch::pipeline::Action;
using megatorch::pipeline::ActionKind;

inline Action F(int64_t mb, int64_t c = 0) { return {ActionKind::kForward, mb, c, -1}; }
inline Action B(int64_t mb, int64_t c = 0) { return {ActionKind::kBackward, mb, c, -1}; }
inline Action BI(int64_t mb, int64_t c = 0) { return {ActionKind::kBackwardInput, mb, c, -1}; }
inline Action BW(int64_t mb, int64_t c = 0) { return {ActionKind::kBackwardWeight, mb, c, -1}; }
inline Action SA(int64_t mb, int64_t c, int64_t peer) { return {ActionKind::kSendActivation, mb, c, peer}; }
inline Action RA(int64_t mb, int64_t c, int64_t peer) { return {ActionKind::kRecvActivation, mb, c, peer}; }
inline Action SG(int64_t mb, int64_t c, int64_t peer) { return {ActionKind::kSendGrad, mb, c, peer}; }
inline Action RG(int64_t mb, int64_t c, int64_t peer) { return {ActionKind::kRecvGrad, mb, c, peer}; }

}  // namespace schedule_test
