/*
 * fuzz_route_openai.c - libFuzzer target for the OpenAI completions
 * route's JSON decoder: each input is the body of one POST /v1/completions
 * to the real `kvd serve` in this process (tests/fuzz/route_fuzz.h says
 * how, and what every answer must be). Seeds in corpus/route_openai/,
 * tokens in route_openai.dict. Built and run by `make fuzz`.
 */
#include "tests/fuzz/route_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    route_post("/v1/completions", data, size);
    return 0;
}
