/*
 * fuzz_route_llama.c - libFuzzer target for the llama.cpp /completion
 * route's JSON decoder: each input is the body of one POST /completion to
 * the real `kvd serve` in this process (tests/fuzz/route_fuzz.h says how,
 * and what every answer must be). Seeds in corpus/route_llama/, tokens in
 * route_llama.dict. Built and run by `make fuzz`.
 */
#include "tests/fuzz/route_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    route_post("/completion", data, size);
    return 0;
}
