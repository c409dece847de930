/* nonewprivs: prints the effective UID it runs with. Installed set-user-ID root (mode 04755)
 * in the critest image registry.k8s.io/e2e-test-images/nonewprivs (e2e/critest_images.py):
 * started as UID 1000 it prints "Effective uid: 0" when the kernel honours the set-user-ID
 * bit and "Effective uid: 1000" under no_new_privs. Built static with `gcc -static -Os`. */
#include <stdio.h>
#include <unistd.h>

int main(void) {
    printf("Effective uid: %d\n", (int)geteuid());
    return fflush(stdout) == 0 ? 0 : 1;
}
