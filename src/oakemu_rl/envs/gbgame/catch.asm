; ---------------------------------------------------------------------------------------
; CATCH: a tiny Game Boy game for training agents.
;
; A ball falls from the top of the screen in a pseudo-random column. Move the basket with
; LEFT/RIGHT on the D-pad to catch it: each catch adds one to the score. A ball that
; reaches the ground costs a life; after the third miss the game sets wGameOver and stops.
;
; Frame loop: sleep until the vertical blank interrupt, redraw (sprites and the score
; row, which is only safe while the screen is not being drawn), read the D-pad, then run
; one step of game logic. Everything the game knows lives in WRAM at $C000 so an agent or
; a reward function can read it.
; ---------------------------------------------------------------------------------------

; ----- Hardware registers (all in the $FF00 page, reached with ldh) --------------------
rP1     EQU $FF00       ; joypad: write which key group to read, read the low nibble
rDIV    EQU $FF04       ; divider: counts up 16384 times a second
rIF     EQU $FF0F       ; interrupts requested
rLCDC   EQU $FF40       ; LCD control
rSCY    EQU $FF42       ; background scroll Y
rSCX    EQU $FF43       ; background scroll X
rLY     EQU $FF44       ; line being drawn (144..153 = vertical blank)
rBGP    EQU $FF47       ; background palette
rOBP0   EQU $FF48       ; sprite palette 0
rIE     EQU $FFFF       ; interrupts enabled

LCDC_ON     EQU %10010011   ; LCD on, tiles at $8000, sprites on (8x8), background on
PALETTE     EQU %11100100   ; colours 0..3 = white, light, dark, black
IE_VBLANK   EQU %00000001

VRAM_TILES  EQU $8000       ; tile N's 16 bytes start at $8000 + 16*N
BG_MAP      EQU $9800       ; 32x32 background tile map, one byte per tile
OAM         EQU $FE00       ; sprite table: 40 entries of Y, X, tile, attributes

; ----- Tiles ---------------------------------------------------------------------------
TILE_BLANK  EQU 0
TILE_BASKET EQU 1           ; left half; the right half is the next tile
TILE_BALL   EQU 3
TILE_GROUND EQU 4
TILE_HEART  EQU 5
TILE_DIGIT0 EQU $10         ; digits 0..9 are tiles $10..$19

; ----- Playfield (screen pixels; a sprite sits at OAM Y = y + 16, OAM X = x + 8) ------
PLAYER_Y    EQU 128         ; basket row (tile row 16)
PLAYER_W    EQU 16          ; the basket is two sprites wide
PLAYER_MAXX EQU 160 - PLAYER_W
PLAYER_STEP EQU 2           ; pixels per frame while the D-pad is held
START_X     EQU 72          ; basket starts in the middle
SPAWN_Y     EQU 8           ; balls appear just under the score row
CATCH_Y     EQU PLAYER_Y - 8 ; ball's bottom touches the basket's top
GROUND_Y    EQU 136         ; ball lies on the ground (tile row 17): a miss
START_LIVES EQU 3

SCORE_MAP   EQU BG_MAP + 1          ; four score digits at row 0, columns 1..4
HEART_MAP   EQU BG_MAP + 16         ; heart icon at row 0, column 16
LIVES_MAP   EQU BG_MAP + 17         ; lives digit at row 0, column 17
GROUND_MAP  EQU BG_MAP + 17 * 32    ; ground at row 17

; ----- Game state (WRAM) ---------------------------------------------------------------
SECTION "state", WRAM0[$C000]
wScore:     ds 2        ; catches, 16-bit little-endian binary
wScoreBCD:  ds 2        ; the same count in BCD (low byte first), for the display
wLives:     ds 1        ; lives left, 3 at the start
wGameOver:  ds 1        ; 0 while playing, 1 once the last life is lost
wPlayerX:   ds 1        ; basket's left edge, 0..PLAYER_MAXX
wObjectX:   ds 1        ; ball's left edge (a multiple of 8)
wObjectY:   ds 1        ; ball's top edge, SPAWN_Y..GROUND_Y
wJoypad:    ds 1        ; D-pad this frame: bit 0 right, 1 left, 2 up, 3 down (1 = held)
wRandom:    ds 1        ; pseudo-random generator state
wFrames:    ds 2        ; frames of play, 16-bit little-endian (stops at game over)
wCatches:   ds 1        ; balls caught (wraps at 256), 0 when the game starts
wMisses:    ds 1        ; balls missed
wVBlank:    ds 1        ; set by the vertical blank interrupt
wStateEnd:

; ----- Interrupt vector: vertical blank ------------------------------------------------
SECTION "vblank", ROM0[$0040]
    push af
    ld a, 1
    ld [wVBlank], a     ; tell WaitVBlank that a new frame has begun
    pop af
    reti

; ----- Cartridge header ----------------------------------------------------------------
SECTION "header", ROM0[$0100]
    nop
    jp Start
    ; $0104: the logo bitmap the boot ROM compares before it starts a cartridge
    db $CE, $ED, $66, $66, $CC, $0D, $00, $0B, $03, $73, $00, $83, $00, $0C, $00, $0D
    db $00, $08, $11, $1F, $88, $89, $00, $0E, $DC, $CC, $6E, $E6, $DD, $DD, $D9, $99
    db $BB, $BB, $67, $63, $6E, $0E, $EC, $CC, $DD, $DC, $99, $9F, $BB, $B9, $33, $3E
    db "OAKCATCH"       ; $0134: title, padded with zeros to 16 bytes
    ds 8, 0             ; ($0143 = 0: a plain Game Boy cartridge, no colour features)
    db 0, 0             ; $0144: new licensee code (none)
    db 0                ; $0146: no Super Game Boy functions
    db 0                ; $0147: cartridge type: ROM only
    db 0                ; $0148: ROM size: 32 KiB, no banking
    db 0                ; $0149: no cartridge RAM
    db 1                ; $014A: destination: overseas
    db 0                ; $014B: old licensee code (none)
    db 0                ; $014C: version 0
    db 0                ; $014D: header checksum, filled in by build.py
    dw 0                ; $014E: global checksum (big-endian), filled in by build.py

; ----- Start-up ------------------------------------------------------------------------
SECTION "main", ROM0[$0150]
Start:
    di
    ld sp, $FFFE

    ; The LCD may only be switched off during vertical blank.
.waitVBlank:
    ldh a, [rLY]
    cp 144
    jr c, .waitVBlank
    xor a
    ldh [rLCDC], a

    ; Tile graphics: stored one bit per pixel, expanded to the 2-bit format (colour 3).
    ld hl, Tiles
    ld de, VRAM_TILES
    ld b, TilesEnd - Tiles
    call Copy1bpp
    ld hl, Digits
    ld de, VRAM_TILES + 16 * TILE_DIGIT0
    ld b, DigitsEnd - Digits
    call Copy1bpp

    ; Background: blank everywhere, a heart by the lives digit, ground along row 17.
    ld hl, BG_MAP
    ld bc, 32 * 32
    ld d, TILE_BLANK
    call Fill
    ld a, TILE_HEART
    ld [HEART_MAP], a
    ld hl, GROUND_MAP
    ld bc, 20
    ld d, TILE_GROUND
    call Fill

    ; Sprite table: all entries at Y = 0, which hides them.
    ld hl, OAM
    ld bc, 160
    ld d, 0
    call Fill

    ; Game state: zero everything, then set what does not start at zero.
    ld hl, wScore
    ld bc, wStateEnd - wScore
    ld d, 0
    call Fill
    ld a, START_LIVES
    ld [wLives], a
    ld a, START_X
    ld [wPlayerX], a
    ldh a, [rDIV]       ; seed: the divider's value at power-on
    ld [wRandom], a
    call SpawnBall

    ; Palettes and scroll, then the screen back on with the vertical blank interrupt.
    ld a, PALETTE
    ldh [rBGP], a
    ldh [rOBP0], a
    xor a
    ldh [rSCY], a
    ldh [rSCX], a
    call Draw
    ld a, LCDC_ON
    ldh [rLCDC], a
    xor a
    ldh [rIF], a
    ld a, IE_VBLANK
    ldh [rIE], a
    ei

; ----- Main loop: one pass per frame ---------------------------------------------------
MainLoop:
    call WaitVBlank
    call Draw           ; first, while the screen is in vertical blank
    call ReadJoypad
    ld a, [wGameOver]
    and a
    jr nz, MainLoop     ; game over: keep the picture, change nothing
    call MovePlayer
    call MoveBall
    ld hl, wFrames      ; 16-bit frame counter
    inc [hl]
    jr nz, MainLoop
    inc hl
    inc [hl]
    jr MainLoop

; Sleep (halt) until the vertical blank interrupt has set wVBlank.
WaitVBlank:
    xor a
    ld [wVBlank], a
.sleep:
    halt
    ld a, [wVBlank]
    and a
    jr z, .sleep
    ret

; ----- Drawing (vertical blank only) ---------------------------------------------------
Draw:
    ld hl, OAM
    ; sprites 0 and 1: the basket's left and right halves
    ld a, [wPlayerX]
    add 8
    ld b, a             ; b = OAM X of the left half
    ld a, PLAYER_Y + 16
    ld [hl+], a
    ld a, b
    ld [hl+], a
    ld a, TILE_BASKET
    ld [hl+], a
    xor a
    ld [hl+], a
    ld a, PLAYER_Y + 16
    ld [hl+], a
    ld a, b
    add 8
    ld [hl+], a
    ld a, TILE_BASKET + 1
    ld [hl+], a
    xor a
    ld [hl+], a
    ; sprite 2: the ball, hidden (Y = 0) once the game is over
    ld a, [wGameOver]
    and a
    ld a, 0
    jr nz, .ballY
    ld a, [wObjectY]
    add 16
.ballY:
    ld [hl+], a
    ld a, [wObjectX]
    add 8
    ld [hl+], a
    ld a, TILE_BALL
    ld [hl+], a
    xor a
    ld [hl], a
    ; the score's four BCD digits, high byte first, then the lives digit
    ld hl, SCORE_MAP
    ld a, [wScoreBCD + 1]
    call PutBCD
    ld a, [wScoreBCD]
    call PutBCD
    ld a, [wLives]
    add TILE_DIGIT0
    ld [LIVES_MAP], a
    ret

; Write the two BCD digits in a to the map at hl, hl += 2.
PutBCD:
    ld b, a
    swap a
    and $0F
    add TILE_DIGIT0
    ld [hl+], a
    ld a, b
    and $0F
    add TILE_DIGIT0
    ld [hl+], a
    ret

; ----- Input ---------------------------------------------------------------------------
; Select the D-pad group (bit 4 low), read it a few times so the lines settle, and store
; the inverted low nibble (the hardware reads 0 for a held key).
ReadJoypad:
    ld a, $20
    ldh [rP1], a
    ldh a, [rP1]
    ldh a, [rP1]
    ldh a, [rP1]
    ldh a, [rP1]
    cpl
    and $0F
    ld [wJoypad], a
    ld a, $30           ; deselect both groups
    ldh [rP1], a
    ret

; ----- Game logic ----------------------------------------------------------------------
; RIGHT moves the basket right, LEFT moves it left (both held: right wins), clamped to
; the screen.
MovePlayer:
    ld a, [wJoypad]
    ld b, a
    ld a, [wPlayerX]
    bit 0, b
    jr z, .notRight
    add PLAYER_STEP
    cp PLAYER_MAXX + 1
    jr c, .store
    ld a, PLAYER_MAXX
    jr .store
.notRight:
    bit 1, b
    ret z
    sub PLAYER_STEP
    jr nc, .store
    xor a               ; went below zero
.store:
    ld [wPlayerX], a
    ret

; The ball falls one pixel a frame. At CATCH_Y it is caught if it overlaps the basket;
; otherwise it falls on, and at GROUND_Y it is lost.
MoveBall:
    ld a, [wObjectY]
    inc a
    ld [wObjectY], a
    cp CATCH_Y
    jr z, .atBasket
    cp GROUND_Y
    ret nz
    ; on the ground: one life fewer
    ld hl, wMisses
    inc [hl]
    ld hl, wLives
    dec [hl]
    jr z, .gameOver
    jp SpawnBall
.gameOver:
    ld a, 1
    ld [wGameOver], a
    ret
.atBasket:
    ; overlap when ball_x + 8 > player_x and ball_x < player_x + PLAYER_W
    ld a, [wPlayerX]
    ld b, a
    ld a, [wObjectX]
    add 7
    cp b
    ret c               ; ball entirely left of the basket
    ld a, b
    add PLAYER_W
    ld b, a
    ld a, [wObjectX]
    cp b
    ret nc              ; ball entirely right of the basket
    ; caught: count it in binary and in BCD, then drop a new ball
    ld hl, wScore
    inc [hl]
    jr nz, .bcd
    inc hl
    inc [hl]
.bcd:
    ld a, [wScoreBCD]
    add 1
    daa
    ld [wScoreBCD], a
    ld a, [wScoreBCD + 1]
    adc 0
    daa
    ld [wScoreBCD + 1], a
    ld hl, wCatches
    inc [hl]
    ; fall through

; A new ball at the top, in one of the 16 columns 2..17 (x = 16..136).
SpawnBall:
    call Random
    and $0F
    add 2
    add a               ; column * 8
    add a
    add a
    ld [wObjectX], a
    ld a, SPAWN_Y
    ld [wObjectY], a
    ret

; a = next pseudo-random byte: state * 5 + 1, mixed with the divider. The divider
; depends on how many cycles have run, so different play gives different balls, while
; the same inputs from power-on always give the same ones.
Random:
    ld a, [wRandom]
    ld b, a
    add a
    add a
    add b
    inc a
    ld b, a
    ldh a, [rDIV]
    xor b
    ld [wRandom], a
    ret

; ----- Helpers -------------------------------------------------------------------------
; Copy b bytes from hl to de, writing each twice (both bit planes: colour 3 on 0).
Copy1bpp:
    ld a, [hl+]
    ld [de], a
    inc de
    ld [de], a
    inc de
    dec b
    jr nz, Copy1bpp
    ret

; Fill bc bytes from hl with d.
Fill:
    ld a, d
    ld [hl+], a
    dec bc
    ld a, b
    or c
    jr nz, Fill
    ret

; ----- Graphics, one bit per pixel, 8 bytes per tile, top row first --------------------
Tiles:
    db $00, $00, $00, $00, $00, $00, $00, $00   ; 0 blank
    db $C0, $C0, $C0, $C0, $E0, $7F, $3F, $00   ; 1 basket, left half
    db $03, $03, $03, $03, $07, $FE, $FC, $00   ; 2 basket, right half
    db $3C, $7E, $FF, $FF, $FF, $FF, $7E, $3C   ; 3 ball
    db $FF, $AA, $55, $AA, $55, $AA, $55, $AA   ; 4 ground
    db $66, $FF, $FF, $FF, $7E, $3C, $18, $00   ; 5 heart
TilesEnd:

Digits:
    db $3C, $66, $6E, $76, $66, $66, $3C, $00   ; 0
    db $18, $38, $18, $18, $18, $18, $7E, $00   ; 1
    db $3C, $66, $06, $0C, $30, $60, $7E, $00   ; 2
    db $3C, $66, $06, $1C, $06, $66, $3C, $00   ; 3
    db $0C, $1C, $3C, $6C, $7E, $0C, $0C, $00   ; 4
    db $7E, $60, $7C, $06, $06, $66, $3C, $00   ; 5
    db $3C, $60, $7C, $66, $66, $66, $3C, $00   ; 6
    db $7E, $06, $0C, $18, $30, $30, $30, $00   ; 7
    db $3C, $66, $66, $3C, $66, $66, $3C, $00   ; 8
    db $3C, $66, $66, $3E, $06, $0C, $38, $00   ; 9
DigitsEnd:
