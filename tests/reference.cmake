# Reference backend, ops CPU twins, float64 oracle and the reference vectors.
set(_ref ${CMAKE_CURRENT_SOURCE_DIR}/reference)

mlart_test(test_ref_ops LABELS cpu SOURCES ${_ref}/test_ref_ops.c)
mlart_test(test_ref_backend LABELS cpu SOURCES ${_ref}/test_ref_backend.c)
mlart_test(test_ref_vectors LABELS cpu SOURCES ${_ref}/test_ref_vectors.c)
