// The one error type of the C++ core. Its kind decides the Python exception class
// (ValueError / TypeError / RuntimeError) the binding raises; the message always names
// the argument, what it got and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dmattn {

enum class ErrorKind { kValue, kType, kRuntime, kNotImplemented };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  // Python-side class name for this kind.
  const char* python_kind() const;

 private:
  ErrorKind kind_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}
}  // namespace detail

// check(cond, ErrorKind::kValue, "q: expected rank 4, got ", rank)
template <typename... Parts>
inline void check(bool cond, ErrorKind kind, const Parts&... parts) {
  if (cond) return;
  std::ostringstream os;
  detail::append(os, parts...);
  throw Error(kind, os.str());
}

template <typename... Parts>
[[noreturn]] inline void fail(ErrorKind kind, const Parts&... parts) {
  std::ostringstream os;
  detail::append(os, parts...);
  throw Error(kind, os.str());
}

}  // namespace dmattn
