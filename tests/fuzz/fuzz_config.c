/* libFuzzer harness: the INI configuration reader on arbitrary file
 * contents (through a file in /dev/shm, else $TMPDIR or /tmp, as
 * mlart_config_read_file takes a path), then the checks of
 * mlart_config_finish. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "mlart/config.h"

static char path[4096];

static void remove_file(void)
{
    unlink(path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    mlart_config cfg;
    FILE *fp;
    if (!path[0]) {
        const char *dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        snprintf(path, sizeof path, "%s/mlart-fuzz-config-%d.ini", dir, (int)getpid());
        atexit(remove_file);
    }
    fp = fopen(path, "wb");
    if (!fp)
        abort();
    if (size && fwrite(data, 1, size, fp) != size)
        abort();
    fclose(fp);
    mlart_config_init(&cfg);
    if (mlart_config_read_file(&cfg, path) == 0)
        (void)mlart_config_finish(&cfg);
    return 0;
}
