// Errors: every failed check throws moekit::Error with file:line, the failed condition and a message
// that names what was wrong (the tensor, the expected shape, the valid choices).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moekit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const char* condition, const std::string& message);

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace moekit

// MOEKIT_CHECK(cond, parts...): throws moekit::Error("file:line: check `cond` failed: parts...").
#define MOEKIT_CHECK(cond, ...)                                                                        \
  do {                                                                                                 \
    if (!(cond)) [[unlikely]]                                                                          \
      ::moekit::detail::throw_error(__FILE__, __LINE__, #cond, ::moekit::detail::concat(__VA_ARGS__)); \
  } while (0)

// MOEKIT_FAIL(parts...): throws unconditionally.
#define MOEKIT_FAIL(...) \
  ::moekit::detail::throw_error(__FILE__, __LINE__, nullptr, ::moekit::detail::concat(__VA_ARGS__))
