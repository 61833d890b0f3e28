// Python module entry point of torch_kvoffload._C. Importing it runs the static TORCH_LIBRARY_IMPL
// registrations of every kernel file linked into it; it also holds one thread setting that has no
// Python API in torch.

#include <Python.h>

#include <ATen/Parallel.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// set_thread_intraop_threads(n): the calling thread's intra-op (OpenMP) thread count, only for this
// thread. torch.set_num_threads is process-wide. Both per-thread first-use initialisations (this
// library's at::parallel_for and libtorch's) run first: each would otherwise reset the count to the
// process-wide one the first time it runs on this thread. Returns at::get_num_threads() afterwards.
PyObject* set_thread_intraop_threads(PyObject* /*self*/, PyObject* arg) {
  const long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred() != nullptr) {
    return nullptr;
  }
  if (n < 1 || n > 4096) {
    PyErr_Format(PyExc_ValueError, "set_thread_intraop_threads: 'n' must be in [1, 4096], got %ld", n);
    return nullptr;
  }
  at::internal::lazy_init_num_threads();
  (void)at::get_num_threads();
#ifdef _OPENMP
  omp_set_num_threads(static_cast<int>(n));
#endif
  return PyLong_FromLong(at::get_num_threads());
}

PyMethodDef kvoffload_methods[] = {
    {"set_thread_intraop_threads", set_thread_intraop_threads, METH_O,
     "Set the calling thread's intra-op thread count (other threads keep theirs)."},
    {nullptr, nullptr, 0, nullptr}};

struct PyModuleDef kvoffload_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kvoffload_methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&kvoffload_module);
}
