// Python module entry point of torch_kvoffload._C. The module itself is empty: importing it runs the
// static TORCH_LIBRARY_IMPL registrations of every kernel file linked into it.

#include <Python.h>

static struct PyModuleDef kvoffload_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&kvoffload_module);
}
