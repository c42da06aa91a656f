/* Internal: backend table validation shared by the registry and the layer. */
#ifndef MLART_RUNTIME_REGISTRY_H
#define MLART_RUNTIME_REGISTRY_H

#include "mlart/backend.h"

/* Check a table before use: ABI major, struct_size, name (against `name`
 * unless NULL), required slots.  `where` names its origin in messages.
 * Returns 0 or MLART_EABI. */
int mlart_backend_validate(const mlart_backend_vtable *vt, const char *name, const char *where);

#endif
