#include "moekit/version.h"

namespace moekit {

const char* version() { return MOEKIT_VERSION_STRING; }

}  // namespace moekit
