#pragma once
// Megatron's (argparse's) convention for a flag given twice: the last occurrence wins. Launch
// scripts append overrides to a shared argument list (`$COMMON_ARGS --global-batch-size 4`),
// which CLI11 refuses ("At Most 1 required but received 2") or, for a list, concatenates.
// keep_last_occurrences drops every earlier occurrence of an option from argv, so CLI11 sees
// each option once: a scalar, a flag (--x / --no-x of one option alike) and a list (argparse's
// nargs='*': the second --data-path replaces the whole first list) all take their last value.
// An option declared cumulative, `->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)`
// (argparse's action='append', e.g. megatorch-generate's --prompt), keeps every occurrence.
// Positional arguments, unknown options and everything after `--` are left to CLI11.
//
// Header-only and NOT included from megatorch/megatorch.h: it needs <CLI/CLI.hpp>, which only
// the programs have.
#include <CLI/CLI.hpp>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "megatorch/check.h"

namespace megatorch::util {

struct LastWins {
  std::vector<std::string> args;       // argv[0] and the tokens kept, in their order
  std::vector<std::string> overrides;  // one line per repeated option, in the order first given
};

namespace cli_detail {

// The named subcommand `token` selects from `app` or an ancestor (as CLI11 does: not one
// whose App has already taken as many subcommands as it allows).
inline const CLI::App* find_subcommand(const CLI::App& app, const std::string& token,
                                       const std::map<const CLI::App*, size_t>& taken) {
  for (const CLI::App* a = &app; a != nullptr; a = a->get_parent()) {
    const auto it = taken.find(a);
    if (a->get_require_subcommand_max() != 0 && it != taken.end() && it->second >= a->get_require_subcommand_max()) {
      continue;
    }
    for (const CLI::App* s : a->get_subcommands([](const CLI::App*) { return true; })) {
      if (!s->get_name().empty() && s->check_name(token)) return s;
    }
  }
  return nullptr;
}

// CLI11's test (App::_recognize) for a token that is not a value: `--`, a subcommand, a long
// or short option (a negative number is a value unless a digit names a short option).
inline bool is_option_like(const CLI::App& app, const std::string& token, const std::map<const CLI::App*, size_t>& taken) {
  std::string name, rest;
  if (token == "--" || find_subcommand(app, token, taken) != nullptr || CLI::detail::split_long(token, name, rest)) return true;
  if (!CLI::detail::split_short(token, name, rest)) return false;
  return !std::isdigit(static_cast<unsigned char>(name[0])) || app.get_option_no_throw("-" + name) != nullptr;
}

inline std::string option_name(const CLI::Option& o) {
  return o.get_lnames().empty() ? "-" + o.get_snames().front() : "--" + o.get_lnames().front();
}

}  // namespace cli_detail

// argv with only the last occurrence of each (non-cumulative) option of `app` and its
// subcommands, and the override lines "<program>: --flag given N times; using the last: V
// (overrides U)". Options are told apart by their CLI::Option, so aliases (-p and
// --pipeline-model-parallel-size, --x and --no-x) count as one; an option's values are taken
// as CLI11 takes them (--name=value, -nVALUE, its expected count, up to the next option for a
// list).
inline LastWins keep_last_occurrences(const CLI::App& app, const std::vector<std::string>& argv,
                                      const std::string& program) {
  MEGATORCH_CHECK(!argv.empty(), program, ": expected argv to start with the program's name, got an empty argv; "
                  "pass main's argc and argv unchanged");
  struct Occurrence {
    size_t begin, end;  // its tokens [begin, end) in argv
    std::string text;   // its values, or its spelling for a flag
  };
  std::map<const CLI::Option*, std::vector<Occurrence>> seen;
  std::vector<const CLI::Option*> order;
  std::map<const CLI::App*, size_t> taken;  // subcommands chosen under each App
  const CLI::App* current = &app;
  size_t i = 1;
  while (i < argv.size() && argv[i] != "--") {  // after `--` everything is positional
    const std::string& token = argv[i];
    if (const CLI::App* sub = cli_detail::find_subcommand(*current, token, taken)) {
      ++taken[sub->get_parent()];
      current = sub;  // the options that follow are the subcommand's
      ++i;
      continue;
    }
    std::string name, value;
    const CLI::Option* opt = nullptr;
    std::string spelling;
    if (CLI::detail::split_long(token, name, value)) {
      spelling = "--" + name;
    } else if (CLI::detail::split_short(token, name, value)) {
      spelling = "-" + name;
    }
    if (!spelling.empty() && cli_detail::is_option_like(*current, token, taken)) opt = current->get_option_no_throw(spelling);
    const bool flag = opt != nullptr && opt->get_items_expected_max() == 0;
    // A positional, an unknown option, or short flags bundled as -abc: CLI11's business.
    if (opt == nullptr || (flag && spelling[1] != '-' && !value.empty())) {
      ++i;
      continue;
    }
    const size_t begin = i++;
    std::vector<std::string> values;
    if (!value.empty()) values.push_back(value);
    if (!flag) {  // as CLI::App::_parse_arg: the minimum unconditionally, then values up to an option
      const size_t min = static_cast<size_t>(std::min(opt->get_type_size_min(), opt->get_items_expected_min()));
      size_t max = static_cast<size_t>(opt->get_items_expected_max());
      if (max >= CLI::detail::expected_max_vector_size / 16 && !opt->get_allow_extra_args()) {
        max = static_cast<size_t>(opt->get_type_size_max()) * static_cast<size_t>(opt->get_expected_min());
      }
      while (values.size() < min && i < argv.size()) values.push_back(argv[i++]);
      if (values.size() < max || opt->get_allow_extra_args()) {
        while ((values.size() < max || opt->get_allow_extra_args()) && i < argv.size() &&
               !cli_detail::is_option_like(*current, argv[i], taken)) {
          values.push_back(argv[i++]);
        }
        if (i < argv.size() && argv[i] == "--") ++i;  // CLI11 takes a `--` that ends a list with it
      }
    }
    // A flag as it was spelled (--x, --no-x, --x=false), an option by its values.
    std::string text = flag || values.empty() ? token : values[0];
    for (size_t k = 1; k < values.size(); ++k) text += " " + values[k];
    if (seen[opt].empty()) order.push_back(opt);
    seen[opt].push_back({begin, i, text});
  }

  std::vector<bool> dropped(argv.size(), false);
  LastWins out;
  for (const CLI::Option* opt : order) {
    const auto& occurrences = seen[opt];
    const auto policy = opt->get_multi_option_policy();
    if (occurrences.size() < 2 || policy == CLI::MultiOptionPolicy::TakeAll || policy == CLI::MultiOptionPolicy::Join) {
      continue;
    }
    std::string earlier;
    for (size_t k = 0; k + 1 < occurrences.size(); ++k) {
      earlier += (k ? ", " : "") + occurrences[k].text;
      for (size_t t = occurrences[k].begin; t < occurrences[k].end; ++t) dropped[t] = true;
    }
    out.overrides.push_back(program + ": " + cli_detail::option_name(*opt) + " given " +
                            std::to_string(occurrences.size()) + " times; using the last: " + occurrences.back().text +
                            " (overrides " + earlier + ")");
  }
  for (size_t t = 0; t < argv.size(); ++t) {
    if (!dropped[t]) out.args.push_back(argv[t]);
  }
  return out;
}

// app.parse(argc, argv) with the last occurrence of a repeated option winning; returns the
// override lines for the caller to log. Throws CLI11's errors (CLI::ParseError) as app.parse does.
inline std::vector<std::string> parse_last_wins(CLI::App& app, int argc, const char* const* argv,
                                                const std::string& program) {
  LastWins kept = keep_last_occurrences(app, std::vector<std::string>(argv, argv + argc), program);
  std::vector<const char*> kept_argv;
  for (const std::string& a : kept.args) kept_argv.push_back(a.c_str());
  app.parse(static_cast<int>(kept_argv.size()), kept_argv.data());
  return kept.overrides;
}

// True on the process that prints a program's notes before any process group exists: the
// only one without torchrun, else RANK 0.
inline bool is_launch_rank_zero() {
  const char* rank = std::getenv("RANK");
  return rank == nullptr || *rank == '\0' || std::string(rank) == "0";
}

// CLI11_PARSE with the last occurrence winning: the override lines go to stderr once (RANK 0;
// stdout may carry JSON); --help and parse errors end the program as CLI11_PARSE does.
// Returns the exit code when main should return, nothing when parsing succeeded.
inline std::optional<int> parse_or_exit(CLI::App& app, int argc, const char* const* argv, const std::string& program) {
  std::vector<std::string> overrides;
  try {
    overrides = parse_last_wins(app, argc, argv, program);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (is_launch_rank_zero()) {
    for (const std::string& line : overrides) std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
  return std::nullopt;
}

}  // namespace megatorch::util
