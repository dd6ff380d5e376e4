// Precompiled header: the torch headers every megatorch translation unit includes.
#pragma once
#include <torch/torch.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
