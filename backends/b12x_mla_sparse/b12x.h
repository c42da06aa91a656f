/* The sm_90 sparse MLA decode backend. */
#ifndef MLART_BACKENDS_B12X_H
#define MLART_BACKENDS_B12X_H

#include "mlart/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

const mlart_backend_vtable *mlart_backend_b12x_mla_sparse_vtable(void);

#ifdef __cplusplus
}
#endif
#endif
