#pragma once
// Umbrella header: everything a C++ user of megatorch needs.
#include "megatorch/check.h"
#include "megatorch/comm/comm_stats.h"
#include "megatorch/comm/group.h"
#include "megatorch/comm/mappings.h"
#include "megatorch/parallel/launch_env.h"
#include "megatorch/parallel/parallel_state.h"
#include "megatorch/parallel/process_group_factory.h"
#include "megatorch/parallel/rank_layout.h"
