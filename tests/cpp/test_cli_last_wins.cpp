// util::parse_last_wins: a repeated command-line option takes its last value, as Megatron's
// argparse does (launch scripts append overrides to shared arguments), with one override line
// per such option; gpt_pretrain's parser through it.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "megatorch/train/arguments.h"
#include "megatorch/util/cli_last_wins.h"

namespace mu = megatorch::util;
using Catch::Matchers::Contains;

namespace {

// A parser with one option of each kind, as the programs declare them.
struct Flags {
  CLI::App app{"test"};
  int64_t x = 0;
  bool fast = false, fused = true;
  std::vector<std::string> list, prompts, rest;

  Flags() {
    app.add_option("--x,-x,--ex", x);
    app.add_flag("--fast", fast);
    app.add_flag("--fused,!--no-fused", fused);
    app.add_option("--list", list);
    app.add_option("--prompt", prompts)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);  // cumulative
    app.add_option("rest", rest);
  }

  std::vector<std::string> parse(std::vector<const char*> argv) {
    argv.insert(argv.begin(), "prog");
    return mu::parse_last_wins(app, static_cast<int>(argv.size()), argv.data(), "prog");
  }
};

megatorch::train::TrainArguments pretrain_arguments(std::vector<std::string> args) {
  args.insert(args.begin(), "gpt_pretrain");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return megatorch::train::parse_arguments(static_cast<int>(argv.size()), argv.data());
}

}  // namespace

TEST_CASE("A repeated scalar option takes its last value and names the one it overrides", "[cli]") {
  Flags f;
  const auto lines = f.parse({"--x", "8", "--fast", "--x", "4"});
  CHECK(f.x == 4);
  CHECK(f.fast);
  CHECK(lines == std::vector<std::string>{"prog: --x given 2 times; using the last: 4 (overrides 8)"});

  Flags three;  // --name=value and --name value are one option; every earlier value named
  CHECK(three.parse({"--x=1", "--x", "2", "--x=3"}) ==
        std::vector<std::string>{"prog: --x given 3 times; using the last: 3 (overrides 1, 2)"});
  CHECK(three.x == 3);

  Flags once;  // given once: nothing to report, CLI11 sees argv as it was
  CHECK(once.parse({"--x", "5", "--list", "a", "b"}).empty());
  CHECK(once.x == 5);
  CHECK(once.list == std::vector<std::string>{"a", "b"});
}

TEST_CASE("Aliases of one option count as one option", "[cli]") {
  Flags f;
  const auto lines = f.parse({"-x", "1", "--ex", "2", "-x3"});
  CHECK(f.x == 3);
  CHECK(lines == std::vector<std::string>{"prog: --x given 3 times; using the last: 3 (overrides 1, 2)"});

  Flags negative;  // a negative number is a value, not a short option
  CHECK(negative.parse({"--x", "-5", "--x", "-7"}).size() == 1);
  CHECK(negative.x == -7);
}

TEST_CASE("A repeated boolean flag takes its last spelling", "[cli]") {
  Flags off;
  const auto lines = off.parse({"--fused", "--no-fused"});
  CHECK_FALSE(off.fused);
  CHECK(lines == std::vector<std::string>{"prog: --fused given 2 times; using the last: --no-fused (overrides --fused)"});

  Flags on;
  on.parse({"--no-fused", "--fast", "--fused", "--fast=false"});
  CHECK(on.fused);
  CHECK_FALSE(on.fast);
}

TEST_CASE("A repeated list option takes the last list whole (argparse's nargs='*')", "[cli]") {
  Flags f;
  const auto lines = f.parse({"--list", "1", "a", "2", "b", "--x", "1", "--list", "c"});
  CHECK(f.list == std::vector<std::string>{"c"});  // CLI11 alone would give 1 a 2 b c
  CHECK(lines == std::vector<std::string>{"prog: --list given 2 times; using the last: c (overrides 1 a 2 b)"});
}

TEST_CASE("A cumulative option (TakeAll, argparse's append) keeps every occurrence", "[cli]") {
  Flags f;
  const auto lines = f.parse({"--prompt", "hello", "--x", "1", "--prompt", "world"});
  CHECK(f.prompts == std::vector<std::string>{"hello", "world"});
  CHECK(lines.empty());
}

TEST_CASE("Positional arguments and everything after -- are left alone", "[cli]") {
  Flags f;
  const auto lines = f.parse({"p1", "--x", "1", "-3", "--x", "2", "--", "--x", "9", "--fast"});
  CHECK(f.x == 2);
  CHECK_FALSE(f.fast);
  CHECK(f.rest == std::vector<std::string>{"p1", "-3", "--x", "9", "--fast"});
  CHECK(lines.size() == 1);

  // The dropped occurrence's list ended with `--`, which CLI11 takes with the list.
  Flags list;
  list.parse({"--list", "a", "--list", "b", "--", "p"});
  CHECK(list.list == std::vector<std::string>{"b"});
  CHECK(list.rest == std::vector<std::string>{"p"});
}

TEST_CASE("Options after a subcommand are the subcommand's", "[cli]") {
  CLI::App app{"test"};
  app.require_subcommand(1);
  int64_t top = 0, limit = 0;
  std::string prefix;
  app.add_option("--limit", top);
  auto* docs = app.add_subcommand("docs", "");
  docs->add_option("prefix", prefix)->required();
  docs->add_option("--limit", limit);
  std::vector<const char*> argv{"prog", "--limit", "1", "docs", "--limit", "2", "docs", "--limit", "3"};
  const auto lines = mu::parse_last_wins(app, static_cast<int>(argv.size()), argv.data(), "prog");
  CHECK(top == 1);
  CHECK(limit == 3);
  CHECK(prefix == "docs");  // the one subcommand taken, a second `docs` is its positional
  CHECK(lines == std::vector<std::string>{"prog: --limit given 2 times; using the last: 3 (overrides 2)"});
}

TEST_CASE("CLI11's own errors and the helper's stay errors", "[cli]") {
  Flags f;
  CHECK_THROWS_AS(f.parse({"--x", "1", "--x", "two"}), CLI::ParseError);  // the last value is still checked
  CHECK_THROWS_AS(f.parse({"--unknown", "--unknown"}), CLI::ParseError);
  CHECK_THROWS_WITH(mu::keep_last_occurrences(f.app, {}, "prog"), Contains("expected argv to start with the program"));
}

TEST_CASE("gpt_pretrain takes a repeated flag's last value (Megatron's launch scripts)", "[cli]") {
  auto a = pretrain_arguments({"--global-batch-size", "8", "--micro-batch-size", "2", "--data-path", "1", "x", "2", "y",
                               "--global-batch-size", "4", "--data-path", "z", "--bf16", "--bf16", "--vocab-size", "257"});
  CHECK(a.global_batch_size == 4);
  CHECK(a.micro_batch_size == 2);
  CHECK(a.data_path == std::vector<std::string>{"z"});
  CHECK(a.bf16);
  CHECK(a.given.count("global-batch-size") == 1);
  CHECK(a.overrides == std::vector<std::string>{
                           "gpt_pretrain: --global-batch-size given 2 times; using the last: 4 (overrides 8)",
                           "gpt_pretrain: --data-path given 2 times; using the last: z (overrides 1 x 2 y)",
                           "gpt_pretrain: --bf16 given 2 times; using the last: --bf16 (overrides --bf16)"});
  megatorch::train::validate(a, 1);
  CHECK(a.num_micro_batches == 2);

  auto plain = pretrain_arguments({"--global-batch-size", "8"});
  CHECK(plain.overrides.empty());

  // Flags that contradict each other are still refused, however often each is given.
  auto both = pretrain_arguments({"--fp16", "--bf16", "--fp16", "--vocab-size", "257"});
  CHECK_THROWS_WITH(megatorch::train::validate(both, 1), Contains("--bf16 and --fp16 contradict each other; pick one"));
  // The value kept is still CLI11's to check.
  CHECK_THROWS_WITH(pretrain_arguments({"--global-batch-size", "8", "--global-batch-size", "four"}),
                    Contains("Could not convert: --global-batch-size = four"));
}
