#include "moekit/error.h"

namespace moekit::detail {

void throw_error(const char* file, int line, const char* condition, const std::string& message) {
  std::ostringstream os;
  os << message;
  os << " [" << file << ":" << line;
  if (condition != nullptr) os << ", check `" << condition << "` failed";
  os << "]";
  throw Error(os.str());
}

}  // namespace moekit::detail
