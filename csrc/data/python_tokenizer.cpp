#include "python_tokenizer.h"

#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "megatorch/check.h"

extern char** environ;

namespace megatorch::data {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// $MEGATORCH_PYTHON, else the interpreter the build was configured with, else python3.
std::string python_interpreter() {
  if (auto p = env_or_empty("MEGATORCH_PYTHON"); !p.empty()) return p;
#ifdef MEGATORCH_BUILD_PYTHON
  if (const std::string p = MEGATORCH_BUILD_PYTHON; !p.empty() && fs::exists(p)) return p;
#endif
  return "python3";
}

// $MEGATORCH_TOKENIZER_SCRIPT, else the installed copy next to this library
// (lib/../share/megatorch/tokenizers.py), else the source tree's file.
std::string tokenizer_script() {
  if (auto p = env_or_empty("MEGATORCH_TOKENIZER_SCRIPT"); !p.empty()) return p;
#ifdef MEGATORCH_TOKENIZER_SCRIPT_FROM_LIB
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&make_python_tokenizer), &info) != 0 && info.dli_fname != nullptr) {
    const fs::path installed = fs::path(info.dli_fname).parent_path() / MEGATORCH_TOKENIZER_SCRIPT_FROM_LIB;
    if (fs::exists(installed)) return installed.lexically_normal().string();
  }
#endif
#ifdef MEGATORCH_SOURCE_TOKENIZER_SCRIPT
  return MEGATORCH_SOURCE_TOKENIZER_SCRIPT;
#else
  return "";
#endif
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

// The child's pid and our end of its socket. Closing the socket ends the child's request
// loop; it is then reaped, killed if it does not exit within seconds. A member, so that a
// constructor that throws after the spawn still reaps it.
struct Child {
  pid_t pid = -1;
  int fd = -1;
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (fd >= 0) close(fd);
    if (pid > 0) reap();
  }
  // Waits for the child to exit (a few seconds at most, then kills it); its status.
  int reap() {
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    pid = -1;
    return status;
  }
};

// How long a reply may take: MEGATORCH_TOKENIZER_TIMEOUT_S, default 600 s (the first
// reply includes importing transformers on a busy machine).
int reply_timeout_ms() {
  const char* env = std::getenv("MEGATORCH_TOKENIZER_TIMEOUT_S");
  if (env == nullptr || *env == '\0') return 600 * 1000;
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  MEGATORCH_CHECK(end != env && *end == '\0' && s >= 0.001 && s <= 86400, "expected MEGATORCH_TOKENIZER_TIMEOUT_S "
                  "to be seconds in [0.001, 86400], got '", env, "'");
  return static_cast<int>(s * 1000);
}

// One tokenizers.py --serve process, spoken to over a socket pair as its stdin and stdout
// (a socket so that a send to a dead child is an error, not SIGPIPE). Its stderr is ours:
// a Python traceback reaches the user as is.
class PythonTokenizer final : public Tokenizer {
 public:
  explicit PythonTokenizer(const TokenizerOptions& o) : type_(o.tokenizer_type()) {
    python_ = python_interpreter();
    script_ = tokenizer_script();
    MEGATORCH_CHECK(!script_.empty() && fs::exists(script_), type_, " runs megatorch's tokenizers.py, which is not at '",
                    script_, "'; set MEGATORCH_TOKENIZER_SCRIPT to its path (torch_ext/megatorch/tokenizers.py in the "
                    "source tree, share/megatorch/tokenizers.py in an install)");
    std::vector<std::string> args = {python_, script_, "--serve", "--tokenizer-type", type_};
    for (const auto& [flag, value] : {std::pair<const char*, std::string>{"--vocab-file", o.vocab_file()},
                                      {"--merge-file", o.merge_file()},
                                      {"--tokenizer-model", o.tokenizer_model()}}) {
      if (!value.empty()) args.insert(args.end(), {flag, value});
    }
    spawn(args);
    const json hello = receive();
    vocab_size_ = hello.at("vocab_size").get<int64_t>();
    eod_ = hello.at("eod").get<int64_t>();
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  bool has_text() const override { return true; }
  std::string name() const override { return type_; }

  std::vector<int64_t> tokenize(const std::string& text) override {
    send({{"op", "tokenize"}, {"text", text}});
    return receive().at("ids").get<std::vector<int64_t>>();
  }

  std::string detokenize(const std::vector<int64_t>& ids) override {
    send({{"op", "detokenize"}, {"ids", ids}});
    return receive().at("text").get<std::string>();
  }

 private:
  void spawn(const std::vector<std::string>& args) {
    int sv[2];
    MEGATORCH_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, type_,
                    ": cannot create a socket pair for the tokenizer process: ", std::strerror(errno));
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, sv[1], 0);  // dup2 clears close-on-exec on 0 and 1
    posix_spawn_file_actions_adddup2(&actions, sv[1], 1);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const int rc = posix_spawnp(&child_.pid, python_.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(sv[1]);
    child_.fd = sv[0];
    if (rc != 0) {
      child_.pid = -1;
      MEGATORCH_FAIL(type_, ": cannot run the Python interpreter '", python_, "' (", std::strerror(rc),
                     "); set MEGATORCH_PYTHON to a python that has the tokenizers/transformers/sentencepiece packages");
    }
  }

  // The child is gone: reap it and say how it ended.
  [[noreturn]] void child_died(const std::string& when) {
    int status = 0;
    std::string how = "closed its output";
    if (child_.pid > 0) {
      status = child_.reap();  // a child that closed its socket but lingers is killed
      how = describe_status(status);
    }
    MEGATORCH_FAIL(type_, ": the tokenizer process (", python_, " ", script_, ") ", how, " ", when,
                   " (any error it printed is above); check that ", python_,
                   " runs and has the tokenizers/transformers/sentencepiece packages, or set MEGATORCH_PYTHON");
  }

  void send(const json& request) {
    MEGATORCH_CHECK(child_.pid > 0, type_, ": the tokenizer process has already ended");
    const std::string line = request.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
    for (size_t done = 0; done < line.size();) {
      const ssize_t n = ::send(child_.fd, line.data() + done, line.size() - done, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) child_died("while receiving a request");
      done += static_cast<size_t>(n);
    }
  }

  json receive() {
    MEGATORCH_CHECK(child_.pid > 0, type_, ": the tokenizer process has already ended");
    size_t eol;
    while ((eol = buffer_.find('\n')) == std::string::npos) {
      // A hung interpreter must not hang the job: wait for the reply with a deadline.
      pollfd ready{child_.fd, POLLIN, 0};
      const int timeout = reply_timeout_ms();
      const int polled = poll(&ready, 1, timeout);
      if (polled < 0 && errno == EINTR) continue;
      if (polled == 0) {
        kill(child_.pid, SIGKILL);
        child_.reap();
        MEGATORCH_FAIL(type_, ": the tokenizer process (", python_, " ", script_, ") did not answer within ",
                       timeout / 1000.0, " s ", started_ ? "a request" : "of starting",
                       " and was stopped; set MEGATORCH_TOKENIZER_TIMEOUT_S if it needs longer");
      }
      char chunk[1 << 16];
      const ssize_t n = recv(child_.fd, chunk, sizeof(chunk), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) child_died(started_ ? "while answering a request" : "while starting");
      buffer_.append(chunk, static_cast<size_t>(n));
    }
    json reply;
    try {
      reply = json::parse(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(eol));
    } catch (const json::exception& e) {
      MEGATORCH_FAIL(type_, ": the tokenizer process sent a line that is not JSON (", e.what(), "): '",
                     buffer_.substr(0, std::min<size_t>(eol, 200)), "'");
    }
    buffer_.erase(0, eol + 1);
    started_ = true;
    if (const auto it = reply.find("error"); it != reply.end()) MEGATORCH_FAIL(it->get<std::string>());
    return reply;
  }

  std::string type_, python_, script_;
  Child child_;
  std::string buffer_;
  bool started_ = false;
  int64_t vocab_size_ = 0;
  int64_t eod_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> make_python_tokenizer(const TokenizerOptions& options) {
  return std::make_unique<PythonTokenizer>(options);
}

}  // namespace megatorch::data
