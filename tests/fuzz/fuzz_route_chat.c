/*
 * fuzz_route_chat.c - libFuzzer target for the chat routes' JSON decoder:
 * each input is posted twice to the real `kvd serve` in this process, as
 * the body of POST /v1/chat/completions and of POST /apply-template (they
 * share the messages decoder and the template; tests/fuzz/route_fuzz.h
 * says how, and what every answer must be). Seeds in corpus/route_chat/,
 * tokens in route_chat.dict. Built and run by `make fuzz`.
 */
#include "tests/fuzz/route_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    route_post("/v1/chat/completions", data, size);
    route_post("/apply-template", data, size);
    return 0;
}
