#pragma once
// The NCCL-semantics check: every rank's trace (nccl_trace.h) replayed under NCCL's rules,
// so a multi-rank run on Gloo proves what the same calls would do on GPUs.
//
// The rules (as ProcessGroupNCCL posts them):
// - Collectives: every member of a communicator issues the same collectives in the same
//   order, agreeing on kind, dtype, element count, reduce op and root.
// - Point-to-point: between a pair of ranks on a communicator the k-th send pairs with the
//   k-th receive, whatever their tags: the tags (what the caller meant to pair) and sizes
//   must agree. A batch_p2p group pairs on the communicator itself; a lone send or receive
//   on the pair's own connection (c10d's per-pair communicator), so the two never pair
//   with each other.
// - Streams: a communicator's collectives and batches run in issue order on its stream; a
//   lone send or receive on its pair's stream. An op starts once the op before it on its
//   stream completed and the works its rank waited for before posting it completed (the
//   stream waits for the compute stream). A collective completes when every member's has
//   started; a send or receive when its partner's op has started; a batch when all of its
//   transfers have.
// An op that never completes is a deadlock on NCCL even where Gloo (pairing by tag,
// sends that never wait) ran it. Each violation is reported with the communicator, the
// ranks, the ops' sequence numbers and the two conflicting ops (or what each stuck rank's
// first op waits for).
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/comm/nccl_trace.h"

namespace megatorch::comm {

struct NcclCheckReport {
  int64_t ranks = 0;
  int64_t communicators = 0;
  int64_t collectives = 0;  // over all ranks
  int64_t transfers = 0;    // sends and receives, over all ranks
  int64_t batches = 0;
  int64_t waits = 0;
};

// Checks the traces of every rank of a run (one per rank; any order). Throws on a
// violation (MEGATORCH_FAIL, the message says which and how to fix it).
NcclCheckReport check_nccl_semantics(const std::vector<RankTrace>& traces);

// Every rank's trace through `store` under `key`/<rank> (this rank's: take_trace), then
// the check on every rank. Collective over the `world` ranks of the store; no process group
// is used, so the exchange itself adds nothing to any trace.
NcclCheckReport check_nccl_semantics_across_ranks(const c10::intrusive_ptr<c10d::Store>& store,
                                                  const std::string& key, int64_t rank, int64_t world);

}  // namespace megatorch::comm
