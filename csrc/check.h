// Input checks with error messages that never go through std::ostream.
//
// Formatting a number through std::ostream inside this extension crashed (SIGSEGV in
// basic_ostream::_M_insert<long>) on the GPU machine, whose toolchain puts a second copy of
// libstdc++'s stream code into the extension; TORCH_CHECK formats its extra arguments that way.
// LSF_CHECK builds the message with std::string / std::to_string only and hands TORCH_CHECK one
// string, which it passes through untouched. Use LSF_CHECK for every check whose message has
// more than one piece.
#pragma once

#include <string>
#include <type_traits>

#include <ATen/ATen.h>

namespace lsf {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void append(std::string& s, double v) { s += std::to_string(v); }
template <typename I, typename std::enable_if<std::is_integral<I>::value, int>::type = 0>
inline void append(std::string& s, I v) {
  s += std::to_string(v);
}

template <typename... A>
std::string message(const A&... a) {
  std::string s;
  (append(s, a), ...);
  return s;
}

}  // namespace lsf

#define LSF_CHECK(cond, ...) TORCH_CHECK(cond, ::lsf::message(__VA_ARGS__))
