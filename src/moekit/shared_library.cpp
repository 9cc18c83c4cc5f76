// libmoekit.so holds the static libraries whole (CMakeLists.txt, moekit_shared); CMake wants one source of
// its own for a shared library, and this is it: there is no code here.
