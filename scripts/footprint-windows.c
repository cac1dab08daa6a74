/* Reads valgrind lackey's --trace-mem=yes output on stdin and, every W guest instructions
 * (argv[1]), prints one line: the window's number, the distinct code pages and distinct
 * data pages it touched, then those data pages (hex page numbers). scripts/footprint-guest
 * builds and runs it in the VM; lackey's log is far too large to keep. Pages past 2048 in
 * one window are not counted (no round trip comes near). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SLOTS 4096

static unsigned long data_set[SLOTS], code_set[SLOTS], data_list[SLOTS];
static int n_data, n_code;

/* Adds page p to an open-addressed set (p + 1 stored, 0 is empty); lists it when new. */
static void add(unsigned long *set, unsigned long p, int *n, unsigned long *list)
{
	unsigned h = (unsigned)((p * 0x9E3779B97F4A7C15ul) >> 52) & (SLOTS - 1);
	while (set[h]) {
		if (set[h] == p + 1)
			return;
		h = (h + 1) & (SLOTS - 1);
	}
	if (*n >= SLOTS / 2)
		return;
	set[h] = p + 1;
	if (list)
		list[*n] = p;
	(*n)++;
}

int main(int argc, char **argv)
{
	long w = argc > 1 ? atol(argv[1]) : 0, instr = 0, window = 0;
	char line[256];
	if (w <= 0) {
		fprintf(stderr, "usage: footprint-windows INSTRUCTIONS_PER_WINDOW < lackey-log\n");
		return 2;
	}
	while (fgets(line, sizeof line, stdin)) {
		if (line[0] == 'I' && line[1] == ' ') {
			add(code_set, strtoul(line + 3, 0, 16) >> 12, &n_code, 0);
			if (++instr % w)
				continue;
			printf("%ld %d %d", window++, n_code, n_data);
			for (int i = 0; i < n_data; i++)
				printf(" %lx", data_list[i]);
			putchar('\n');
			memset(data_set, 0, sizeof data_set);
			memset(code_set, 0, sizeof code_set);
			n_data = n_code = 0;
		} else if (line[0] == ' ' && strchr("LSM", line[1])) {
			add(data_set, strtoul(line + 3, 0, 16) >> 12, &n_data, data_list);
		}
	}
	return 0;
}
